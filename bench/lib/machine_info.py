"""What machine a benchmark ran on, recorded in every results file."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def code_version() -> str | None:
    """The checkout's commit, with "+changes" when tracked files other than documentation, tests and
    kept results (docs/, Markdown files, tests/, bench/results/: what perf_tables.py does not count as
    code either) differ from it; None outside git."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        changes = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    changed = [line[3:] for line in changes.stdout.splitlines() if line.strip()]
    is_code_changed = any(not (path.startswith(("docs/", "tests/", "bench/results/")) or path.endswith(".md"))
                          for path in changed)
    return commit.stdout.strip() + ("+changes" if is_code_changed else "")


def machine(*packages: str) -> dict:
    """CPU, usable cores, Python and platform, the code's commit, plus the versions of the packages named."""
    info = {"cpu": cpu_name(), "num_cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "platform": platform.platform(), "commit": code_version()}
    for name in packages:
        info[name] = importlib.import_module(name).__version__
    return info
