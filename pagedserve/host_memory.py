"""The host's memory as the processes of a replica may use it, and the CPU defaults drawn from it.

Total memory is /proc/meminfo's MemTotal, or the container's limit (cgroup v2 memory.max, v1
memory.limit_in_bytes) where that is lower. No torch: `serve` checks the flags against the host
with these numbers before it starts anything, and the worker sizes its KV pool with them.

The KV pool on a CPU device, by default:

    pool = clamp(10 % x (total memory - weights), 256 MiB, 2 GiB), split between the ranks

A share of *total* memory (not of what is free at that moment) gives the same pool on every start
of the same host, and a small one: on a 2-core host a CPU decodes a few dozen sequences at a
usable speed, which 2 GiB holds many times over (SmolLM2-135M in float32 keeps 45 KiB of KV per
token: 2 GiB is 46k tokens, 180 sequences of 256; the demo model's 2 KiB per token, a million),
while the rest of a shared 24 GiB host stays with the other jobs. The floor keeps a small host or
container usable (a few full-length sequences), the cap keeps the KV tensors from taking a big
host's memory for tokens a CPU could not decode anyway. (The pool's pages take memory as its
blocks are first written, worker/cache_engine.py, so the pool is the most a replica's KV takes.)
The ranks of a CPU replica share one host (as `serve` starts them), so they split one budget.
Swap space on a CPU device defaults to none: a preempted group is recomputed, rather than copied
into more of the same memory (on CUDA, swap is host memory beside the GPU's: 4 GiB per rank).
"""

from __future__ import annotations

import os
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
CPU_KV_FRACTION = 0.10
CPU_KV_MIN_BYTES = 256 * MIB
CPU_KV_MAX_BYTES = 2 * GIB
CUDA_SWAP_SPACE_GIB = 4.0
CPU_SWAP_SPACE_GIB = 0.0
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit() -> int | None:
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def total_memory() -> int:
    """Bytes of memory this host (or container) has in all."""
    total = _meminfo("MemTotal")
    if total is None:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_limit()
    return min(total, limit) if limit is not None else total


def available_memory() -> int:
    """Bytes that can be allocated now without swapping (MemAvailable, at most the total)."""
    available = _meminfo("MemAvailable")
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(available, total_memory())


def cpu_kv_pool_bytes(total_bytes: int, weight_bytes: int, num_ranks: int = 1) -> int:
    """One rank's default KV pool on a CPU device: see the module docstring. weight_bytes are the
    weights of the whole replica (every rank's share) on this host."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, not {num_ranks}")
    share = int(max(total_bytes - weight_bytes, 0) * CPU_KV_FRACTION)
    return min(max(share, CPU_KV_MIN_BYTES), CPU_KV_MAX_BYTES) // num_ranks


def default_swap_space_gib(device_type: str) -> float:
    """Swap space per rank when --swap-space is not given: none on a CPU device, 4 GiB on CUDA."""
    return CUDA_SWAP_SPACE_GIB if device_type == "cuda" else CPU_SWAP_SPACE_GIB
