"""Preemption: the cost rule of "auto", and swap / recompute runs that must match a run without
memory pressure token for token."""

from __future__ import annotations

import pytest
from scheduler_harness import RequestSpec, run_workload

from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.kv.block_pool import BlockPool
from pagedserve.scheduler.core.preemption import PreemptionMode, choose_preemption_mode, num_tokens_to_recompute
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import Sequence


def _config(**overrides) -> SchedulerConfig:
    arguments = {"num_gpu_blocks": 12, "max_model_len": 256, "block_size": 4, "num_cpu_blocks": 64,
                 "max_num_seqs": 8, "max_num_batched_tokens": 32} | overrides
    return SchedulerConfig(**arguments)


def _specs() -> list[RequestSpec]:
    specs = [RequestSpec(f"r{i}", [(5 * i + t) % 19 + 1 for t in range(9 + i)],
                         SamplingParams(max_tokens=14, ignore_eos=True, n=1 + i % 2, temperature=1.0, seed=i),
                         arrival_step=i) for i in range(4)]
    specs.append(RequestSpec("beam", [3, 1, 4, 1, 5, 9], SamplingParams(max_tokens=8, beam_width=2), arrival_step=1))
    return specs


def _completions(result) -> dict:
    return {name: record.completions for name, record in result.records.items()}


@pytest.fixture(scope="module")
def reference() -> dict:
    return _completions(run_workload(_config(num_gpu_blocks=1024), _specs()))


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_each_mode_gives_the_outputs_of_a_run_without_pressure(mode: str, reference: dict) -> None:
    result = run_workload(_config(preemption_mode=mode), _specs())
    stats = result.scheduler.stats()
    assert _completions(result) == reference
    if mode == "swap":
        assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute == 0
        assert any(plan.blocks_to_swap_out for plan in result.plans)
        assert any(plan.blocks_to_swap_in for plan in result.plans)
    elif mode == "recompute":
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
        assert not any(plan.blocks_to_swap_out for plan in result.plans)
    else:
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0


def test_auto_mode_picks_per_group(reference: dict) -> None:
    # 1 per block against 0.3 per token: full 4-token blocks swap, a group whose blocks are
    # mostly empty or held by other requests too is recomputed.
    result = run_workload(_config(preemption_mode="auto", swap_seconds_per_block=1.0,
                                  recompute_seconds_per_token=0.3, num_gpu_blocks=14), _specs())
    stats = result.scheduler.stats()
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute > 0
    assert _completions(result) == reference


def test_swap_falls_back_to_recompute_without_cpu_space(reference: dict) -> None:
    result = run_workload(_config(preemption_mode="swap", num_cpu_blocks=0), _specs())
    stats = result.scheduler.stats()
    assert stats.num_preemptions_swap == 0 and stats.num_preemptions_recompute > 0
    assert _completions(result) == reference


def test_swapped_out_blocks_are_moved_once_per_physical_block() -> None:
    def check(scheduler, plan) -> None:
        gpu_blocks = [gpu for gpu, _ in plan.blocks_to_swap_out]
        cpu_blocks = [cpu for _, cpu in plan.blocks_to_swap_out]
        assert len(set(gpu_blocks)) == len(gpu_blocks) and len(set(cpu_blocks)) == len(cpu_blocks)

    result = run_workload(_config(preemption_mode="swap"), _specs(), on_step=check)
    assert result.scheduler.stats().num_preemptions_swap > 0


def test_the_newest_running_group_is_preempted_first() -> None:
    victims: list[str] = []

    def watch(scheduler, plan) -> None:
        if plan.blocks_to_swap_out:
            victim = max(scheduler.swapped, key=lambda group: group.arrival_index)
            victims.append(victim.request_id)
            assert all(group.arrival_index < victim.arrival_index for group in scheduler.running)

    specs = [RequestSpec(f"r{i}", list(range(1 + i, 11 + i)), SamplingParams(max_tokens=14, ignore_eos=True))
             for i in range(3)]
    run_workload(_config(preemption_mode="swap", num_gpu_blocks=9), specs, on_step=watch)
    assert victims[0] == "r2"


def test_auto_rule_compares_swap_and_recompute_costs() -> None:
    config = _config(swap_seconds_per_block=1.0, recompute_seconds_per_token=0.5)
    assert choose_preemption_mode(config, num_blocks=3, num_recompute_tokens=7, can_swap=True) is PreemptionMode.SWAP
    assert choose_preemption_mode(config, num_blocks=3, num_recompute_tokens=6, can_swap=True) is PreemptionMode.RECOMPUTE
    assert choose_preemption_mode(config, num_blocks=1, num_recompute_tokens=99, can_swap=False) is PreemptionMode.RECOMPUTE
    swap_only = _config(preemption_mode="swap")
    assert choose_preemption_mode(swap_only, num_blocks=99, num_recompute_tokens=1, can_swap=True) is PreemptionMode.SWAP
    recompute_only = _config(preemption_mode="recompute")
    assert choose_preemption_mode(recompute_only, num_blocks=1, num_recompute_tokens=99,
                                  can_swap=True) is PreemptionMode.RECOMPUTE


def test_recompute_estimate_counts_shared_prefix_once_and_skips_blocks_other_requests_hold() -> None:
    pool = BlockPool(8, enable_caching=True)
    a = Sequence(seq_id=0, output_index=0, token_ids=list(range(12)), num_prompt_tokens=8, num_computed_tokens=11)
    b = Sequence(seq_id=1, output_index=1, token_ids=list(range(12)), num_prompt_tokens=8, num_computed_tokens=10)
    shared = [pool.allocate(), pool.allocate()]
    for block in shared:
        pool.acquire(block)
    a.block_table = shared + [pool.allocate()]
    b.block_table = shared + [pool.allocate()]
    assert num_tokens_to_recompute([a, b], pool, block_size=4) == 8 + 3 + 2
    pool.acquire(shared[0])  # another request holds the first block too
    assert num_tokens_to_recompute([a, b], pool, block_size=4) == 4 + 3 + 2
