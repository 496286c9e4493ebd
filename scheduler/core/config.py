"""Validated configuration of the scheduler core and its step loop (pool sizes, step budget,
policies, waiting queue, worker recovery): the one definition of those settings. The flags of
`pagedserve scheduler` (and those `serve` forwards) are derived from the fields' metadata
(pagedserve.config.flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.config.flags import internal, option
from pagedserve.scheduler.core.errors import SchedulerConfigError
from pagedserve.config.shared_options import block_size_option, enable_lora_option, kv_cache_dir_option, max_loras_option
from pagedserve.contracts.tier_ops import layout_dir

PREEMPTION_MODES = ("auto", "swap", "recompute")
SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
DEFAULT_MAX_WAITING_TOKENS = 1 << 20
GIB = 1 << 30
BLOCK_FILE_OVERHEAD_BYTES = 1024  # a block file's header, at most (worker/kv_tiers/block_file.py)


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """Everything the scheduler needs to know about the deployment, keyword-only.

    Two sizes may be unknown (None) until the scheduler process has read the model and heard from
    its workers: num_gpu_blocks (None: what every rank has room for; set: at most that many, the
    `--num-kv-blocks` override) and max_model_len (None: the model's max_position_embeddings).
    The scheduler process fills in max_model_len (server.run_scheduler) and the Engine the pool
    sizes (dataclasses.replace) before a Scheduler is built, which refuses a config that still
    lacks them (check_complete).

    The two cost constants drive preemption_mode="auto" (see preemption.py): the estimated time
    to move one block to CPU and back, and the estimated time to recompute one token's KV in a
    prefill; only their ratio decides. The defaults are measured for the demo model
    (`--model demo`) on the CPU, one torch thread on a 2-core host, by
    `python bench/kv_memory.py --parts swap` (medians over groups of 64-2048 tokens and over six
    runs; the tables are in docs/memory.md, "Swap versus recompute"). A swap is a memory copy there,
    cheaper per block than recomputing one token, so "auto" swaps unless most of a group's blocks
    are also held by other requests. A 7B model on a PCIe 4 GPU is nearer 6.5e-4 s per block and
    7.0e-5 s per token (recomputing groups of up to 18 tokens); measure and override them per
    deployment.
    """

    num_gpu_blocks: int | None = option(
        None, flag="--num-kv-blocks", metavar="N", serve=True,
        help="KV pool size in blocks (overrides the memory-derived size)")
    max_model_len: int | None = option(
        None, metavar="N", serve=True,
        help="longest prompt plus output in tokens (default and upper bound: the model's max_position_embeddings)")
    block_size: int = block_size_option()
    num_cpu_blocks: int = internal(0)  # the workers' swap space, known when they register
    max_num_seqs: int = option(256, metavar="N", serve=True, help="sequences in one step at most")
    max_num_batched_tokens: int = option(2048, metavar="N", serve=True, help="tokens in one step at most")
    enable_prefix_caching: bool = option(True, serve=True, help="reuse the KV blocks of a shared prompt prefix")
    preemption_mode: str = option("auto", choices=PREEMPTION_MODES, serve=True,
                                  help="how a request gives its KV blocks back when the pool runs out")
    scheduling_policy: str = option(
        "fcfs", choices=SCHEDULING_POLICIES, serve=True,
        help="fcfs: first come, first served; priority: lower request priority first, then arrival, "
             "and a waiting request preempts running ones of strictly lower priority")
    # Speculative decoding (spec_drafting.py, spec_acceptance.py):
    speculative_method: str = option(
        "none", choices=SPECULATIVE_METHODS, serve=True,
        help="none; ngram: propose the tokens that followed the context's suffix earlier in the request "
             "(prompt lookup), verified by the target model in one forward; draft: the workers' draft model "
             "(--speculative-model on serve and worker) proposes them")
    num_speculative_tokens: int = option(4, metavar="K", serve=True,
                                         help="tokens proposed per sequence and step when speculating")
    ngram_min: int = option(1, metavar="N", serve=True, help="shortest suffix n-gram to look up (ngram)")
    ngram_max: int = option(4, metavar="M", serve=True, help="longest suffix n-gram to look up (ngram)")
    speculative_disable_batch_size: int = option(
        4, metavar="N", serve=True,
        help="no speculation in a step when more sequences than this are running")
    # KV tiers (scheduler/kv/tiers): the host tier's size comes from the workers (--kv-offloading-size),
    # the disk tier's folder from the workers' layout (worker/kv_tiers/layout.py).
    kv_cache_dir: str | None = kv_cache_dir_option()
    kv_cache_disk_size_gib: float = option(
        16.0, flag="--kv-cache-disk-size", metavar="GIB", serve=True,
        help="disk tier budget of --kv-cache-dir (block files of every rank); the least recently used go first")
    num_host_blocks: int = internal(0)  # host tier slots every rank has, known when they register
    kv_layout_id: str = internal("")  # the workers' KV layout, known when they register
    num_kv_block_bytes: int = internal(0)  # one block's KV on one rank
    num_kv_ranks: int = internal(1)
    tier_load_tokens_per_block: float = internal(1.0)  # step budget a block loaded from the host tier costs
    enable_lora: bool = enable_lora_option()
    max_loras: int = max_loras_option()
    swap_seconds_per_block: float = internal(3.3e-5)
    recompute_seconds_per_token: float = internal(5.4e-5)
    # The step loop (engine.py) and its admission control:
    max_waiting_requests: int = option(4096, metavar="N", serve=True,
                                       help="requests not yet scheduled; beyond it RESOURCE_EXHAUSTED")
    max_waiting_tokens: int = option(DEFAULT_MAX_WAITING_TOKENS, metavar="N", serve=True,
                                     help="prompt tokens of requests not yet scheduled; beyond it RESOURCE_EXHAUSTED")
    worker_recovery_timeout: float = option(
        0.0, metavar="SECONDS",
        help="when workers are lost, hold the requests in flight this long for them to register again "
             "(0: fail them at once)")
    startup_timeout: float = internal(600.0)  # registered workers must allocate their KV cache in this time

    def __post_init__(self) -> None:
        if self.num_gpu_blocks is not None:
            _require_int("num_gpu_blocks", self.num_gpu_blocks, minimum=1)
        if self.max_model_len is not None:
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
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise SchedulerConfigError("scheduling_policy", f"must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise SchedulerConfigError("speculative_method", f"must be one of {', '.join(SPECULATIVE_METHODS)}")
        _require_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        _require_int("ngram_min", self.ngram_min, minimum=1)
        _require_int("ngram_max", self.ngram_max, minimum=1)
        if self.ngram_max < self.ngram_min:
            raise SchedulerConfigError("ngram_max", f"must be >= ngram_min ({self.ngram_min})")
        _require_int("speculative_disable_batch_size", self.speculative_disable_batch_size, minimum=0)
        _require_int("max_loras", self.max_loras, minimum=1)
        for name in ("swap_seconds_per_block", "recompute_seconds_per_token", "worker_recovery_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise SchedulerConfigError(name, "must be a finite number >= 0")
        _require_int("num_host_blocks", self.num_host_blocks, minimum=0)
        _require_int("num_kv_block_bytes", self.num_kv_block_bytes, minimum=0)
        _require_int("num_kv_ranks", self.num_kv_ranks, minimum=1)
        for name in ("kv_cache_disk_size_gib", "tier_load_tokens_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise SchedulerConfigError(name, "must be a finite number >= 0")
        if self.kv_cache_dir is not None and not self.kv_cache_dir:
            raise SchedulerConfigError("kv_cache_dir", "must name a folder when given")
        _require_int("max_waiting_requests", self.max_waiting_requests, minimum=1)
        _require_int("max_waiting_tokens", self.max_waiting_tokens, minimum=1)
        if isinstance(self.startup_timeout, bool) or not isinstance(self.startup_timeout, (int, float)) \
                or not self.startup_timeout > 0:
            raise SchedulerConfigError("startup_timeout", "must be a number > 0")

    def check_complete(self) -> None:
        """Raises SchedulerConfigError unless the sizes a Scheduler needs are known."""
        for name in ("num_gpu_blocks", "max_model_len"):
            if getattr(self, name) is None:
                raise SchedulerConfigError(name, "must be known before a Scheduler is built")

    @property
    def is_speculating(self) -> bool:
        return self.speculative_method != "none"

    @property
    def is_draft_model_speculation(self) -> bool:
        """Proposals come from the workers' draft model (the plan carries placeholders)."""
        return self.speculative_method == "draft"

    @property
    def is_priority_policy(self) -> bool:
        return self.scheduling_policy == "priority"

    @property
    def kv_layout_folder(self) -> str | None:
        """The disk tier's folder for the workers' layout; None without a disk tier."""
        if self.kv_cache_dir is None or not self.kv_layout_id:
            return None
        return layout_dir(self.kv_cache_dir, self.kv_layout_id)

    @property
    def max_disk_blocks(self) -> int:
        """Blocks the disk budget holds, every rank's file counted."""
        per_block = (self.num_kv_block_bytes + BLOCK_FILE_OVERHEAD_BYTES) * self.num_kv_ranks
        return int(self.kv_cache_disk_size_gib * GIB) // per_block if self.num_kv_block_bytes else 0

    @property
    def has_kv_tiers(self) -> bool:
        return self.num_host_blocks > 0 or (self.kv_layout_folder is not None and self.max_disk_blocks > 0)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens KV slots."""
        return -(-num_tokens // self.block_size)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchedulerConfigError(name, f"must be an int, got {type(value).__name__}")
    if value < minimum:
        raise SchedulerConfigError(name, f"must be >= {minimum}, got {value}")
