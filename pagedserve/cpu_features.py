"""What the host CPU computes natively, read from /proc/cpuinfo (no torch: the scheduler and
`serve`'s preflight use it too).

`--dtype auto` on a CPU device serves bfloat16 where the cores multiply bfloat16 natively
(AVX-512 BF16 or AMX-BF16: about twice float32's matmul rate and half its memory traffic), and
float32 elsewhere, where bfloat16 matmuls are emulated and slower than float32 ones.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_native_bfloat16(flags: frozenset[str] | None = None) -> bool:
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BFLOAT16_FLAGS)


def cpu_auto_dtype(flags: frozenset[str] | None = None) -> str:
    """The dtype `--dtype auto` picks on a CPU device: bfloat16 with native bfloat16, else float32."""
    return "bfloat16" if has_native_bfloat16(flags) else "float32"
