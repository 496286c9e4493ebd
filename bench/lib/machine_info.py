"""What machine a benchmark ran on, recorded in every results file."""

from __future__ import annotations

import importlib
import os
import platform
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(*packages: str) -> dict:
    """CPU, usable cores, Python and platform, plus the versions of the packages named."""
    info = {"cpu": cpu_name(), "num_cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "platform": platform.platform()}
    for name in packages:
        info[name] = importlib.import_module(name).__version__
    return info
