"""The KV tiers behind the device pool (scheduler/kv/tiers) against the digest worker, whose
tokens depend on every KV value a sequence reads: a block loaded from the host tier or fetched
from a block file with the wrong content changes the tokens. No torch, no processes."""

from __future__ import annotations

import dataclasses
import json
import os

from scheduler_harness import RequestSpec, run_workload

from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.contracts.prefix_hash import full_block_keys
from pagedserve.contracts.tier_ops import block_file_name, parse_block_file_name
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.kv.tiers.disk_index import DiskIndex
from pagedserve.scheduler.kv.tiers.host_index import HostIndex

BLOCK = 4
PREFIX = [(7 * index) % 20 + 2 for index in range(64)]  # 16 full blocks


def _config(**changes) -> SchedulerConfig:
    base = SchedulerConfig(num_gpu_blocks=24, max_model_len=128, block_size=BLOCK, max_num_seqs=4,
                           max_num_batched_tokens=64, preemption_mode="recompute")
    return dataclasses.replace(base, **changes)


def _greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _evicting_workload(tail: list[int], again_at: int = 80) -> list[RequestSpec]:
    """The prefix, then two other long prompts that need the whole pool, then the prefix again."""
    fillers = [[(5 * index + offset) % 19 + 3 for index in range(80)] for offset in (1, 2)]
    return [RequestSpec("first", PREFIX + tail, _greedy()),
            RequestSpec("filler0", fillers[0], _greedy(2), arrival_step=20),
            RequestSpec("filler1", fillers[1], _greedy(2), arrival_step=45),
            RequestSpec("again", PREFIX + tail, _greedy(), arrival_step=again_at)]


def _tokens(result, request_id: str) -> list[int]:
    return result.records[request_id].completions[0].token_ids


def test_host_tier_serves_a_prefix_the_device_pool_evicted() -> None:
    specs = _evicting_workload([3, 4, 5])
    without = run_workload(_config(), specs)
    with_host = run_workload(_config(num_host_blocks=64), specs)
    # without tiers the fillers evict the prefix: the second ask computes it again
    assert without.records["again"].cached_prompt_tokens < 16
    assert with_host.records["again"].cached_prompt_tokens == len(PREFIX)
    assert _tokens(with_host, "again") == _tokens(with_host, "first") == _tokens(without, "again")
    tiers = with_host.scheduler.block_manager.tiers
    assert tiers.stats.hits["host"] >= 12
    assert tiers.stats.bytes_written["host"] == 0  # no block bytes known: counted as 0 per block
    assert any(plan.tier_ops and plan.tier_ops.loads for plan in with_host.plans)


def test_loads_count_against_the_step_token_budget() -> None:
    specs = _evicting_workload([3, 4, 5])
    result = run_workload(_config(num_host_blocks=32, tier_load_tokens_per_block=4.0), specs)
    for plan in result.plans:
        num_loads = len(plan.tier_ops.loads) if plan.tier_ops else 0
        assert plan.num_tokens + 4 * num_loads <= 64
    assert result.records["again"].cached_prompt_tokens > 0
    assert _tokens(result, "again") == _tokens(result, "first")


def _disk_config(folder, **changes) -> SchedulerConfig:
    changes.setdefault("num_host_blocks", 32)  # a disk hit is staged in host slots: room for the prefix
    return _config(kv_cache_dir=str(folder), kv_layout_id="layout-a", num_kv_block_bytes=64, **changes)


def test_a_restart_finds_the_prefix_on_disk(tmp_path) -> None:
    specs = [RequestSpec("first", PREFIX + [3, 4, 5], _greedy())]
    first = run_workload(_disk_config(tmp_path), specs)
    folder = os.path.join(tmp_path, "layout-a")
    assert len([name for name in os.listdir(folder) if parse_block_file_name(name)]) >= 16
    restarted = run_workload(_disk_config(tmp_path), [RequestSpec("again", PREFIX + [3, 4, 5], _greedy())])
    assert restarted.records["again"].cached_prompt_tokens == len(PREFIX)
    assert _tokens(restarted, "again") == _tokens(first, "first")
    stats = restarted.scheduler.block_manager.tiers.stats
    assert stats.hits["disk"] == 16 and stats.num_failed_fetches == 0
    # another layout (model, dtype, block size...) has its own folder: nothing is reused
    other = run_workload(dataclasses.replace(_disk_config(tmp_path), kv_layout_id="layout-b"),
                         [RequestSpec("again", PREFIX + [3, 4, 5], _greedy())])
    assert other.records["again"].cached_prompt_tokens == 0


def test_damaged_block_files_are_skipped_and_removed(tmp_path) -> None:
    specs = [RequestSpec("first", PREFIX + [3, 4, 5], _greedy())]
    first = run_workload(_disk_config(tmp_path), specs)
    folder = os.path.join(tmp_path, "layout-a")
    names = [block_file_name(key, 0) for key in full_block_keys(PREFIX, BLOCK)]
    with open(os.path.join(folder, names[3]), "r+") as file:  # truncated
        file.truncate(5)
    with open(os.path.join(folder, names[9]), "w") as file:  # corrupt
        file.write("not a block")
    with open(os.path.join(folder, "0" * 32 + ".r0.kvb.tmp"), "w") as file:  # a writer killed mid-write
        file.write("[1, 2")
    restarted = run_workload(_disk_config(tmp_path), [RequestSpec("again", PREFIX + [3, 4, 5], _greedy())])
    assert _tokens(restarted, "again") == _tokens(first, "first")
    stats = restarted.scheduler.block_manager.tiers.stats
    assert stats.num_failed_fetches >= 1
    for name in (names[3], names[9]):  # removed, and written again when the block was recomputed
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as file:
                assert len(json.load(file)) == BLOCK


def test_a_full_disk_evicts_the_least_recently_used(tmp_path) -> None:
    config = _disk_config(tmp_path, num_host_blocks=8, kv_cache_disk_size_gib=6 * (64 + 1024) / (1 << 30))
    assert config.max_disk_blocks == 6
    specs = _evicting_workload([3, 4, 5])
    result = run_workload(config, specs)
    folder = os.path.join(tmp_path, "layout-a")
    assert len([name for name in os.listdir(folder) if parse_block_file_name(name)]) <= 6
    assert result.scheduler.block_manager.tiers.evictions()["disk"] > 0
    assert _tokens(result, "again") == _tokens(result, "first")


def test_host_index_pins_and_evicts_least_recently_used() -> None:
    index = HostIndex(2)
    assert index.put(b"a") is not None and index.put(b"b") is not None
    assert index.put(b"c") is None  # both pinned in this step
    index.unpin_step()
    slot_b = index.touch(b"b")
    index.unpin_step()
    slot_c = index.put(b"c")  # evicts a, the least recently used
    assert b"a" not in index and index.slot_of(b"b") == slot_b and index.slot_of(b"c") == slot_c
    index.unpin_step()
    pending = index.put(b"d", is_pending=True)
    assert index.slot_of(b"d") is None and index.is_pending(b"d")
    index.unpin_step()
    assert index.put(b"e") not in (None, pending)
    index.drop(b"d")
    index.check()


def test_disk_index_reads_complete_blocks_of_every_rank(tmp_path) -> None:
    key_a, key_b = bytes(range(16)), bytes(range(1, 17))
    for name in (f"{key_a.hex()}.r0.kvb", f"{key_a.hex()}.r1.kvb", f"{key_b.hex()}.r0.kvb", "other.txt"):
        (tmp_path / name).write_bytes(b"x")
    index = DiskIndex(10)
    assert index.load(str(tmp_path), world_size=2) == []
    assert index.keys() == [key_a]


def test_speculation_and_preemption_by_swap_keep_their_tokens_with_tiers(tmp_path) -> None:
    specs = _evicting_workload([3, 4, 5], again_at=30)  # the prefix comes back while the fillers run
    oracle = run_workload(_config(num_gpu_blocks=400), specs)
    for index, changes in enumerate(({"speculative_method": "ngram"}, {"preemption_mode": "swap", "num_cpu_blocks": 64},
                                     {"speculative_method": "draft"})):
        result = run_workload(_disk_config(tmp_path / str(index), **changes), specs)
        for spec in specs:
            assert _tokens(result, spec.request_id) == _tokens(oracle, spec.request_id), changes
