"""Randomized workloads: invariants after every step, no leaks, every request ends, and under
memory pressure (tiny pools, every preemption mode, chunking, prefix caching on and off, aborts,
stop strings, worker restarts, requests streamed or held to the end, so blocks taken ahead for
decode runs) the tokens equal those of a run with a huge pool, a huge budget and another block
size: the fake worker's tokens depend only on the KV it reads, so they are an oracle."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_harness import EOS_TOKEN_ID, VOCAB_SIZE, RequestSpec, run_workload

from pagedserve.contracts.request_types import FinishReason
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.request_intake import max_group_blocks
from pagedserve.scheduler.core.config import SchedulerConfig

_TOKENS = st.integers(1, VOCAB_SIZE - 1)


@st.composite
def _sampling(draw, min_tokens_out: int = 1) -> SamplingParams:
    kind = draw(st.sampled_from(["single", "single", "parallel", "beam"]))
    max_tokens = draw(st.integers(min_tokens_out, 20))
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(2, max_tokens))),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(1, VOCAB_SIZE - 1), max_size=2)),
        logprobs=draw(st.sampled_from([0, 0, 2])),
    )
    if kind == "parallel":
        params.n = draw(st.integers(2, 3))
        params.temperature = 1.0
        params.seed = draw(st.none() | st.integers(0, 99))
    elif kind == "beam":
        params.beam_width = draw(st.integers(2, 3))
        params.length_penalty = draw(st.sampled_from([1.0, 0.5, 2.0]))
    return params


@st.composite
def _workload(draw, is_crowded: bool = False) -> tuple[SchedulerConfig, list[RequestSpec], frozenset[int]]:
    """Requests with shared prefixes, aborts and stop strings over a pool sized for the largest
    request plus a little; crowded: many long requests at once, nothing to spare."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    prefixes = [draw(st.lists(_TOKENS, min_size=4, max_size=40)) for _ in range(2)]
    specs = []
    num_requests = draw(st.integers(6, 10) if is_crowded else st.integers(2, 9))
    for index in range(num_requests):
        prefix = draw(st.sampled_from([[], *prefixes, *prefixes]))
        sampling = draw(_sampling(10 if is_crowded else 1))
        spec = RequestSpec(
            request_id=f"r{index}",
            prompt_token_ids=prefix + draw(st.lists(_TOKENS, min_size=1, max_size=20)),
            sampling=sampling,
            arrival_step=draw(st.integers(0, 2 if is_crowded else 5)),
            hold_output=draw(st.booleans()),  # runs (blocks ahead) of more sequences when every one holds
        )
        if draw(st.integers(0, 5)) == 0:
            spec.abort_step = spec.arrival_step + draw(st.integers(0, 12))
        elif sampling.n > 1 and draw(st.booleans()):
            spec.finish_step = spec.arrival_step + draw(st.integers(1, 10))
            spec.finish_index = draw(st.integers(0, sampling.n - 1))
        specs.append(spec)
    max_num_seqs = draw(st.sampled_from([3, 8]))
    num_needed = max(max_group_blocks(_probe_config(block_size), len(spec.prompt_token_ids), spec.sampling.max_tokens,
                                      spec.sampling.num_completions, spec.sampling.is_beam_search) for spec in specs)
    config = SchedulerConfig(
        num_gpu_blocks=num_needed + (0 if is_crowded else draw(st.sampled_from([0, 0, 1, 3, 8]))),
        num_cpu_blocks=draw(st.sampled_from([256] if is_crowded else [0, 8, 256, 256])),
        block_size=block_size,
        max_model_len=128,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 48)),
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["swap", "recompute", "auto"])),
        swap_seconds_per_block=1.0,
        recompute_seconds_per_token=draw(st.sampled_from([0.01, 0.3, 10.0])) / block_size,
    )
    reset_steps = frozenset(draw(st.lists(st.integers(1, 30), max_size=2)) if draw(st.integers(0, 4)) == 0 else [])
    return config, specs, reset_steps


def _probe_config(block_size: int) -> SchedulerConfig:
    return SchedulerConfig(num_gpu_blocks=1, max_model_len=128, block_size=block_size)


_ORACLE = SchedulerConfig(num_gpu_blocks=4096, max_model_len=128, block_size=16, max_num_seqs=256,
                          max_num_batched_tokens=4096)


def _oracle_specs(specs: list[RequestSpec]) -> list[RequestSpec]:
    return [RequestSpec(spec.request_id, spec.prompt_token_ids, spec.sampling) for spec in specs]


_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]


@settings(max_examples=200, deadline=None, suppress_health_check=_HEALTH)
@given(_workload())
def test_random_workloads_match_the_oracle(workload) -> None:
    _check_against_oracle(*workload)


@settings(max_examples=60, deadline=None, suppress_health_check=_HEALTH)
@given(_workload(is_crowded=True))
def test_crowded_workloads_match_the_oracle(workload) -> None:
    _check_against_oracle(*workload)


def _check_against_oracle(config: SchedulerConfig, specs: list[RequestSpec], reset_steps: frozenset[int]) -> None:
    # invariants after every step; leak check at the end; resets lose every KV block
    pressured = run_workload(config, specs, reset_steps=reset_steps)
    oracle = run_workload(_ORACLE, _oracle_specs(specs))
    stats = pressured.scheduler.stats()
    event(f"preempted by swap: {stats.num_preemptions_swap > 0}")
    event(f"preempted by recompute: {stats.num_preemptions_recompute > 0}")
    event(f"prefix cache hits: {stats.num_prefix_cache_hits > 0}")
    event(f"copy-on-write: {any(plan.blocks_to_copy for plan in pressured.plans)}")
    for spec in specs:
        record, expected = pressured.records[spec.request_id], oracle.records[spec.request_id]
        assert expected.is_finished
        if record.was_aborted:
            assert not record.is_finished or spec.abort_step is not None
            for index, completion in record.completions.items():
                assert completion.token_ids == expected.completions[index].token_ids[:len(completion.token_ids)]
            continue
        assert record.is_finished, spec.request_id
        assert record.cached_prompt_tokens <= len(spec.prompt_token_ids) - 1
        for index, completion in expected.completions.items():
            got = record.completions[index]
            if index in record.finished_indices:
                assert got.finish_reason is FinishReason.ABORT
                assert got.token_ids == completion.token_ids[:len(got.token_ids)]
            else:
                assert (got.token_ids, got.finish_reason) == (completion.token_ids, completion.finish_reason)
                assert got.cumulative_logprob == completion.cumulative_logprob
                assert got.num_logprobs == (len(got.token_ids) if spec.sampling.logprobs else 0)
        if spec.sampling.is_beam_search:
            assert len(record.completions) == spec.sampling.beam_width
            scores = [record.completions[index].cumulative_logprob for index in range(spec.sampling.beam_width)]
            assert scores == sorted(scores, reverse=True)
        for completion in record.completions.values():
            if completion.finish_reason is FinishReason.STOP:
                stops = set(spec.sampling.stop_token_ids) | (set() if spec.sampling.ignore_eos else {EOS_TOKEN_ID})
                assert completion.token_ids[-1] in stops
                assert len(completion.token_ids) > spec.sampling.min_tokens
            if completion.finish_reason is FinishReason.LENGTH:
                assert len(completion.token_ids) == spec.sampling.max_tokens
