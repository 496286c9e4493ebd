"""What one worker rank's memory goes to, decided once its weights are loaded: the weights, the KV
pool it offers, the swap space, and what is left of the host (the headroom), logged as
`memory_budget`.

    host memory ─┬─ weights      x ranks   (on a CPU device; on CUDA they are on the GPU)
                 ├─ draft model  x ranks   (likewise; with --speculative-model)
                 ├─ KV pool      x ranks   (likewise)
                 ├─ swap space   x ranks   (always host memory: pinned on CUDA)
                 ├─ host KV tier x ranks   (--kv-offloading-size: host memory, pinned on CUDA)
                 └─ headroom               (everything else: frontend, scheduler, other jobs)

With a draft model a block holds the target's KV and the draft's (worker/cache_engine.py): the
pool and the swap space are sized in such pairs, so the block count a rank reports is the same for
both models.

The ranks of a replica are counted as sharing one host, as `serve` starts them. Sizes the
operator chose (--kv-cache-memory, --swap-space, --kv-offloading-size) that leave no headroom at all are refused with a
MemoryBudgetError (the process exits 2, a configuration error); sizes beyond the memory available
right now only give a warning, since other jobs' use comes and goes. The defaults always fit
(pagedserve.host_memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.host_memory import GIB, available_memory, default_swap_space_gib, total_memory


class MemoryBudgetError(ValueError):
    """The explicit memory sizes do not fit the host."""


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Bytes per rank, except num_host_bytes (the host's total) and the headroom."""

    device_type: str  # "cpu" or "cuda"
    num_ranks: int
    num_weight_bytes: int  # the target model's
    num_kv_pool_bytes: int  # the capacity offered (target and draft KV); the scheduler may use fewer blocks
    num_swap_bytes: int
    num_host_bytes: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_draft_weight_bytes: int = 0
    num_bytes_per_block: int = 0  # target and draft KV of one block
    num_draft_bytes_per_block: int = 0  # the draft's part of it
    num_host_tier_bytes: int = 0  # the host KV tier (--kv-offloading-size)
    num_host_blocks: int = 0

    @property
    def num_host_bytes_per_rank(self) -> int:
        weights = self.num_weight_bytes + self.num_draft_weight_bytes
        on_device = weights + self.num_kv_pool_bytes if self.device_type == "cpu" else 0
        return on_device + self.num_swap_bytes + self.num_host_tier_bytes

    @property
    def num_headroom_bytes(self) -> int:
        return self.num_host_bytes - self.num_ranks * self.num_host_bytes_per_rank

    def log_fields(self) -> dict:
        return {"device_type": self.device_type, "num_ranks": self.num_ranks,
                "num_weight_bytes": self.num_weight_bytes, "num_kv_pool_bytes": self.num_kv_pool_bytes,
                "num_swap_bytes": self.num_swap_bytes, "num_host_bytes": self.num_host_bytes,
                "num_headroom_bytes": self.num_headroom_bytes,
                "num_gpu_blocks": self.num_gpu_blocks, "num_cpu_blocks": self.num_cpu_blocks,
                "num_draft_weight_bytes": self.num_draft_weight_bytes, "num_bytes_per_block": self.num_bytes_per_block,
                "num_draft_bytes_per_block": self.num_draft_bytes_per_block,
                "num_host_tier_bytes": self.num_host_tier_bytes, "num_host_blocks": self.num_host_blocks}


def plan_memory(runner, *, device_type: str, num_ranks: int, kv_cache_memory_gib: float | None,
                swap_space_gib: float | None, total_bytes: int | None = None,
                host_tier_gib: float = 0.0) -> MemoryBudget:
    """The budget of a loaded ModelRunner (its KV pool profiled, or the explicit size); raises
    MemoryBudgetError when explicit sizes leave the host no headroom."""
    swap_gib = default_swap_space_gib(device_type) if swap_space_gib is None else swap_space_gib
    num_gpu_blocks = runner.profile_num_blocks(kv_cache_memory_gib=kv_cache_memory_gib)
    num_cpu_blocks = runner.num_blocks_for_bytes(int(swap_gib * GIB))
    num_host_blocks = runner.num_blocks_for_bytes(int(host_tier_gib * GIB))
    bytes_per_block = runner.bytes_per_block  # the draft model's KV included
    draft_shape = runner.draft_cache_shape
    budget = MemoryBudget(
        device_type=device_type, num_ranks=num_ranks, num_weight_bytes=runner.num_weight_bytes,
        num_kv_pool_bytes=num_gpu_blocks * bytes_per_block, num_swap_bytes=num_cpu_blocks * bytes_per_block,
        num_host_bytes=total_memory() if total_bytes is None else total_bytes,
        num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
        num_draft_weight_bytes=runner.num_draft_weight_bytes, num_bytes_per_block=bytes_per_block,
        num_draft_bytes_per_block=draft_shape.bytes_per_block if draft_shape is not None else 0,
        num_host_tier_bytes=num_host_blocks * bytes_per_block, num_host_blocks=num_host_blocks)
    is_explicit = swap_space_gib is not None or host_tier_gib > 0 or (
        kv_cache_memory_gib is not None and device_type == "cpu")
    if is_explicit and budget.num_headroom_bytes <= 0:
        raise MemoryBudgetError(
            f"--kv-cache-memory / --swap-space do not fit this host: {num_ranks} rank(s) x ("
            f"weights {_gib(budget.num_weight_bytes + budget.num_draft_weight_bytes if device_type == 'cpu' else 0)}"
            f"{f' + KV pool {_gib(budget.num_kv_pool_bytes)}' if device_type == 'cpu' else ''}"
            f" + swap {_gib(budget.num_swap_bytes)} + host KV tier {_gib(budget.num_host_tier_bytes)})"
            f" is more than its {_gib(budget.num_host_bytes)} of memory")
    return budget


def exceeds_available(budget: MemoryBudget) -> bool:
    """Whether what this rank is about to allocate in host memory (its KV pool on a CPU device,
    its swap space) is more than is available right now (a warning)."""
    to_allocate = budget.num_swap_bytes + budget.num_host_tier_bytes + (budget.num_kv_pool_bytes if budget.device_type == "cpu" else 0)
    return to_allocate > available_memory()


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
