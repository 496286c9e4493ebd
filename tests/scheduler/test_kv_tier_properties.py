"""Randomized workloads with the KV tiers on (host slots and block files, both small, so they evict
all the time): block invariants across the three tiers after every step (invariants.py), and the
tokens of every request equal the oracle's through evictions, tier hits, aborts, preemption, worker
restarts (the host tier is lost) and a restarted replica that starts from the same folder after
some of its block files were damaged."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from hypothesis import event, given, settings
from hypothesis import strategies as st
from scheduler_harness import run_workload
from test_scheduler_properties import _HEALTH, _check_against_oracle, _workload

from pagedserve.contracts.tier_ops import parse_block_file_name


@st.composite
def _tiered_workload(draw):
    config, specs, reset_steps = draw(_workload())
    config = dataclasses.replace(
        config, enable_prefix_caching=True, num_host_blocks=draw(st.sampled_from([0, 1, 4, 16, 64])),
        num_kv_block_bytes=64, kv_layout_id="layout",
        tier_load_tokens_per_block=draw(st.sampled_from([0.0, 1.0, 3.0])))
    num_disk_blocks = draw(st.sampled_from([0, 2, 8, 1000]))
    damage = draw(st.lists(st.integers(0, 999), max_size=4))
    return config, specs, reset_steps, num_disk_blocks, damage


@settings(max_examples=80, deadline=None, suppress_health_check=_HEALTH)
@given(_tiered_workload())
def test_tiered_workloads_match_the_oracle(workload) -> None:
    config, specs, reset_steps, num_disk_blocks, damage = workload
    with tempfile.TemporaryDirectory() as folder:
        if num_disk_blocks:
            config = dataclasses.replace(config, kv_cache_dir=folder,
                                         kv_cache_disk_size_gib=num_disk_blocks * (64 + 1024) / (1 << 30))
        _check_against_oracle(config, specs, reset_steps)
        layout = os.path.join(folder, "layout")
        names = sorted(os.listdir(layout)) if os.path.isdir(layout) else []
        for index in damage:  # truncated or corrupt files before the restart
            if names:
                with open(os.path.join(layout, names[index % len(names)]), "w") as file:
                    file.write("[1, 2" if index % 2 else "")
        event(f"block files: {bool(names)}")
        _check_against_oracle(config, specs, reset_steps)  # the replica restarted on the same folder
        if num_disk_blocks:
            files = [name for name in os.listdir(layout) if parse_block_file_name(name)] if os.path.isdir(layout) else []
            assert len(files) <= num_disk_blocks + 1  # + one written after the last index change


def test_tiers_see_hits_in_random_runs() -> None:
    """The randomized runs above do exercise the tiers (a guard against a vacuous property)."""
    hits = {"host": 0, "disk": 0}

    @settings(max_examples=30, deadline=None, suppress_health_check=_HEALTH, database=None, derandomize=True)
    @given(_tiered_workload())
    def run(workload) -> None:
        config, specs, reset_steps, _, _ = workload
        with tempfile.TemporaryDirectory() as folder:
            config = dataclasses.replace(config, kv_cache_dir=folder, num_host_blocks=16)
            for _ in range(2):
                result = run_workload(config, specs, reset_steps=reset_steps)
                for tier in hits:
                    hits[tier] += result.scheduler.block_manager.tiers.stats.hits[tier]

    run()
    assert hits["host"] > 0 and hits["disk"] > 0
