"""What machine a benchmark ran on, recorded in every results file."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    """The CPU's model name, with "(AVX2, no AVX-512)" or "(no AVX2)" after it where the CPU lacks
    AVX-512: a virtual machine names an AMD EPYC Zen 3 and a Zen 4 alike ("AMD EPYC"), and the
    kernels differ between them (docs/cpu-limits.md)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                platform.processor() or "unknown")
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None or "avx512f" in flags:
        return name
    return f"{name} (AVX2, no AVX-512)" if "avx2" in flags else f"{name} (no AVX2)"


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
