"""The scheduler's Prometheus metrics (docs/operations.md, "Metrics": the names marked * are pinned), refreshed
after every step and, between steps, a few times a second (scheduler/engine.py, on_idle), so the
gauges are true within a second of any change."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.security.metrics_endpoint import serve_metrics

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REJECT_REASONS = ("queue_full", "invalid", "unavailable", "draining")


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("pagedserve_requests_running",
                                      "Request groups being decoded or prefilled", registry=r)
        self.requests_waiting = Gauge("pagedserve_requests_waiting",
                                      "Requests waiting for their first schedule", registry=r)
        self.requests_swapped = Gauge("pagedserve_requests_swapped",
                                      "Request groups swapped out to CPU", registry=r)
        self.kv_blocks_total = Gauge("pagedserve_kv_blocks_total", "KV blocks in the GPU pool",
                                     registry=r)
        self.kv_blocks_used = Gauge("pagedserve_kv_blocks_used",
                                    "KV blocks referenced by running sequences", registry=r)
        self.preemptions = Counter("pagedserve_preemptions", "Preempted request groups by mode",
                                   ["mode"], registry=r)
        self.prefix_queries = Counter("pagedserve_prefix_cache_queries",
                                      "Full prompt blocks looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("pagedserve_prefix_cache_hits",
                                   "Prompt blocks reused from the prefix cache", registry=r)
        self.step_seconds = Histogram("pagedserve_step_seconds",
                                      "Wall time of one scheduler step (schedule + forward + update)",
                                      buckets=STEP_BUCKETS, registry=r)
        self.queue_time = Histogram("pagedserve_queue_time_seconds",
                                    "Time from a request's arrival at the scheduler to its first schedule",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.requests_rejected = Counter("pagedserve_requests_rejected",
                                         "Requests the scheduler refused before starting them, by reason",
                                         ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.requests_rejected.labels(reason=reason)
        self.spec_drafts = Counter("pagedserve_spec_decode_num_drafts",
                                   "Sequence steps that verified speculative proposals", registry=r)
        self.spec_draft_tokens = Counter("pagedserve_spec_decode_draft_tokens",
                                         "Speculative tokens proposed and verified", registry=r)
        self.spec_accepted_tokens = Counter("pagedserve_spec_decode_accepted_tokens",
                                            "Speculative tokens accepted", registry=r)
        self.spec_accepted_per_position = Counter(
            "pagedserve_spec_decode_accepted_tokens_per_position",
            "Speculative tokens accepted, by position in the proposal (0: the first)", ["position"], registry=r)
        self.spec_unspeculated = Counter(
            "pagedserve_spec_decode_unspeculated_requests",
            "Requests served without speculation although it is on, by reason", ["reason"], registry=r)
        self.kv_tier_hits = Counter("pagedserve_kv_tier_hits",
                                    "Prompt KV blocks reused from a prefix-cache tier (device, host, disk)",
                                    ["tier"], registry=r)
        self.kv_tier_bytes = Counter("pagedserve_kv_tier_bytes",
                                     "KV bytes moved into (write) or out of (read) the host and disk tiers, all ranks",
                                     ["tier", "direction"], registry=r)
        self.kv_tier_evictions = Counter("pagedserve_kv_tier_evictions",
                                         "KV blocks evicted from the host or disk tier", ["tier"], registry=r)
        self.kv_tier_failed_fetches = Counter("pagedserve_kv_tier_failed_fetches",
                                              "Block files that could not be read back (missing, truncated, "
                                              "corrupt) and were dropped", registry=r)
        for tier in ("device", "host", "disk"):
            self.kv_tier_hits.labels(tier=tier)
        for tier in ("host", "disk"):
            self.kv_tier_evictions.labels(tier=tier)
            for direction in ("read", "write"):
                self.kv_tier_bytes.labels(tier=tier, direction=direction)
        self.lora_loads = Counter("pagedserve_lora_adapter_loads",
                                  "LoRA adapters put in a worker slot", registry=r)
        self.lora_evictions = Counter("pagedserve_lora_adapter_evictions",
                                      "LoRA adapter loads that evicted another adapter from its slot (LRU)",
                                      registry=r)
        self._last = {"swap": 0, "recompute": 0, "queries": 0, "hits": 0, "drafts": 0, "draft_tokens": 0,
                      "accepted": 0}

    def serve(self, port: int, host: str | None = None) -> None:
        """/metrics on host:port (host None: loopback), behind the scrape token when one is set
        (pagedserve.security.metrics_endpoint)."""
        serve_metrics(self.registry, port, host)

    def update(self, stats, step_seconds: float | None, queue_seconds: list[float] = ()) -> None:
        self.requests_running.set(stats.num_running)
        self.requests_waiting.set(stats.num_waiting)
        self.requests_swapped.set(stats.num_swapped)
        self.kv_blocks_total.set(stats.gpu.num_total)
        self.kv_blocks_used.set(stats.gpu.num_used)
        self._advance(self.preemptions.labels(mode="swap"), "swap", stats.num_preemptions_swap)
        self._advance(self.preemptions.labels(mode="recompute"), "recompute",
                      stats.num_preemptions_recompute)
        self._advance(self.prefix_queries, "queries", stats.num_prefix_cache_queries)
        self._advance(self.prefix_hits, "hits", stats.num_prefix_cache_hits)
        self._advance(self.lora_loads, "lora_loads", stats.num_lora_loads)
        self._advance(self.lora_evictions, "lora_evictions", stats.num_lora_evictions)
        self._advance(self.spec_drafts, "drafts", stats.num_spec_drafts)
        self._advance(self.spec_draft_tokens, "draft_tokens", stats.num_spec_draft_tokens)
        self._advance(self.spec_accepted_tokens, "accepted", stats.num_spec_accepted_tokens)
        self._advance(self.spec_unspeculated.labels(reason="beam_search"), "unspeculated",
                      stats.num_spec_unspeculated_requests)
        for position, total in enumerate(stats.num_spec_accepted_per_position):
            self._advance(self.spec_accepted_per_position.labels(position=str(position)),
                          f"accepted_at_{position}", total)
        tiers = stats.tiers
        for tier, total in tiers.hits.items():
            self._advance(self.kv_tier_hits.labels(tier=tier), f"tier_hits_{tier}", total)
        for direction, totals in (("read", tiers.bytes_read), ("write", tiers.bytes_written)):
            for tier, total in totals.items():
                self._advance(self.kv_tier_bytes.labels(tier=tier, direction=direction),
                              f"tier_bytes_{tier}_{direction}", total)
        for tier, total in tiers.evictions.items():
            self._advance(self.kv_tier_evictions.labels(tier=tier), f"tier_evictions_{tier}", total)
        self._advance(self.kv_tier_failed_fetches, "tier_failed_fetches", tiers.num_failed_fetches)
        if step_seconds is not None:
            self.step_seconds.observe(step_seconds)
        for seconds in queue_seconds:
            self.queue_time.observe(seconds)

    def clear_gauges(self, num_blocks_total: int) -> None:
        """No scheduler (workers not ready): nothing runs, waits or holds a block."""
        for gauge in (self.requests_running, self.requests_waiting, self.requests_swapped, self.kv_blocks_used):
            gauge.set(0)
        self.kv_blocks_total.set(num_blocks_total)

    def _advance(self, counter, key: str, total: int) -> None:
        """Counters follow the scheduler's running totals (which restart with a new pool)."""
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total

    def reset_totals(self) -> None:
        self._last = dict.fromkeys(self._last, 0)
