"""Counters and gauges the step loop exports as metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.kv.block_pool import BlockPool


@dataclass(slots=True, frozen=True)
class PoolStats:
    num_total: int
    num_free: int
    num_used: int
    num_cached: int  # unreferenced but kept for the prefix cache (always 0 on the CPU)

    @staticmethod
    def of(pool: BlockPool) -> PoolStats:
        return PoolStats(num_total=pool.num_blocks, num_free=pool.num_free, num_used=pool.num_used,
                         num_cached=pool.num_cached)


@dataclass(slots=True, frozen=True)
class TierTotals:
    """Running totals of the KV tiers (scheduler/kv/tiers): per tier hits, bytes, evictions."""

    hits: dict[str, int] = field(default_factory=dict)  # device, host, disk: prefix blocks reused
    bytes_read: dict[str, int] = field(default_factory=dict)  # host, disk
    bytes_written: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    num_failed_fetches: int = 0

    @staticmethod
    def of(tiers) -> TierTotals:
        if tiers is None:
            return TierTotals()
        stats = tiers.stats
        return TierTotals(hits=dict(stats.hits), bytes_read=dict(stats.bytes_read),
                          bytes_written=dict(stats.bytes_written), evictions=tiers.evictions(),
                          num_failed_fetches=stats.num_failed_fetches)


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    num_running: int  # groups (requests), not sequences
    num_waiting: int
    num_swapped: int
    num_running_seqs: int
    gpu: PoolStats
    cpu: PoolStats
    num_steps: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_prefix_cache_queries: int  # full prompt blocks looked up
    num_prefix_cache_hits: int  # of those, blocks reused
    num_spec_drafts: int = 0  # sequences that verified speculative proposals, counted per step
    num_spec_draft_tokens: int = 0  # proposals verified
    num_spec_accepted_tokens: int = 0  # of those, accepted
    num_spec_accepted_per_position: tuple[int, ...] = ()  # [i]: proposal i + 1 accepted
    num_spec_unspeculated_requests: int = 0  # requests a speculating scheduler serves without (beam
    # search; constrained requests under draft-model speculation)
    tiers: TierTotals = field(default_factory=TierTotals)
    num_lora_loads: int = 0  # adapters put in a worker slot
    num_lora_evictions: int = 0  # of those, loads that replaced another adapter (LRU)
