"""Validated configuration of the scheduler core (pool sizes, step budget, policies)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.scheduler.errors import SchedulerConfigError

PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Everything the scheduler needs to know about the deployment, keyword-only.

    The two cost constants drive preemption_mode="auto" (see preemption.py): the estimated time
    to move one block to CPU and back, and the estimated time to recompute one token's KV in a
    prefill; only their ratio decides. The defaults are measured for the demo model
    (`--model demo`) on the CPU, one torch thread on a 2-core host, by
    `python bench/memory.py --parts swap` (medians over groups of 64-2048 tokens and over six
    runs; README "Memory", "Swap versus recompute" has the tables). A swap is a memory copy there, cheaper per block than recomputing one
    token, so "auto" swaps unless most of a group's blocks are also held by other requests. A 7B
    model on a PCIe 4 GPU is nearer 6.5e-4 s per block and 7.0e-5 s per token (recomputing groups
    of up to 18 tokens); measure and override them per deployment.
    """

    num_gpu_blocks: int
    max_model_len: int
    block_size: int = 16
    num_cpu_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"
    swap_seconds_per_block: float = 3.3e-5
    recompute_seconds_per_token: float = 5.4e-5

    def __post_init__(self) -> None:
        _require_int("num_gpu_blocks", self.num_gpu_blocks, minimum=1)
        _require_int("max_model_len", self.max_model_len, minimum=1)
        _require_int("block_size", self.block_size, minimum=1)
        _require_int("num_cpu_blocks", self.num_cpu_blocks, minimum=0)
        _require_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SchedulerConfigError(
                "max_num_batched_tokens",
                f"must be >= max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step",
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise SchedulerConfigError("enable_prefix_caching", "must be a bool")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise SchedulerConfigError("preemption_mode", f"must be one of {', '.join(PREEMPTION_MODES)}")
        for name in ("swap_seconds_per_block", "recompute_seconds_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise SchedulerConfigError(name, "must be a finite number >= 0")

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens KV slots."""
        return -(-num_tokens // self.block_size)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchedulerConfigError(name, f"must be an int, got {type(value).__name__}")
    if value < minimum:
        raise SchedulerConfigError(name, f"must be >= {minimum}, got {value}")
