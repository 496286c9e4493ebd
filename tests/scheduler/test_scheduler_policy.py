"""Scheduling policy: FCFS, budgets, chunked prefill, prefix reuse, sharing, rejections, stops."""

from __future__ import annotations

import pytest
from scheduler_harness import EOS_TOKEN_ID, RequestRecord, RequestSpec, collect, digest_worker, run_workload

from pagedserve.contracts.request_types import FinishReason, Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.errors import RequestRejected, StepOrderError
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.testing.digest_worker import DigestWorker
from pagedserve.contracts.step_plan import SeqSample, StepResult


def _config(**overrides) -> SchedulerConfig:
    arguments = {"num_gpu_blocks": 256, "max_model_len": 2048, "block_size": 4, "num_cpu_blocks": 64,
                 "max_num_seqs": 16, "max_num_batched_tokens": 64} | overrides
    return SchedulerConfig(**arguments)


def _request(request_id: str, prompt: list[int], **sampling) -> Request:
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling=SamplingParams(**sampling),
                   eos_token_ids=[EOS_TOKEN_ID])


def _step(scheduler: Scheduler, worker: DigestWorker, records: dict[str, RequestRecord] | None = None):
    step = scheduler.schedule()
    assert step is not None
    outputs = scheduler.process_result(step, worker.run(step.plan))
    if records is not None:
        collect(records, outputs)
    scheduler.check_invariants()
    return step.plan, outputs


def test_fcfs_admission_and_token_budget() -> None:
    config = _config(max_num_batched_tokens=16)
    scheduler, worker = Scheduler(config), digest_worker(config)
    for offset, name in enumerate(("a", "b", "c")):
        scheduler.add_request(_request(name, list(range(1 + offset, 11 + offset)), max_tokens=4, ignore_eos=True))
    seq_of = {name: scheduler.group_of(name).seqs[0].seq_id for name in ("a", "b", "c")}
    plan, _ = _step(scheduler, worker)
    assert [(s.seq_id, s.start_position, len(s.token_ids)) for s in plan.seqs] == [
        (seq_of["a"], 0, 10), (seq_of["b"], 0, 6)]  # b's prompt is chunked into what is left
    assert [s.sample is not None for s in plan.seqs] == [True, False]
    plan, _ = _step(scheduler, worker)
    # a decodes first, b finishes its prompt, c starts with the rest of the budget
    assert [(s.seq_id, s.start_position, len(s.token_ids)) for s in plan.seqs] == [
        (seq_of["a"], 10, 1), (seq_of["b"], 6, 4), (seq_of["c"], 0, 10)]
    assert plan.num_tokens == 15


def test_decodes_are_served_before_a_long_prefill_chunk() -> None:
    config = _config(max_num_batched_tokens=16)
    scheduler, worker = Scheduler(config), digest_worker(config)
    scheduler.add_request(_request("short", [1, 2, 3], max_tokens=20, ignore_eos=True))
    _step(scheduler, worker)
    scheduler.add_request(_request("long", list(range(1, 101)), max_tokens=2, ignore_eos=True))
    short_id = scheduler.group_of("short").seqs[0].seq_id
    positions = []
    for _ in range(7):
        plan, _ = _step(scheduler, worker)
        assert plan.seqs[0].seq_id == short_id and len(plan.seqs[0].token_ids) == 1
        assert plan.num_tokens <= 16
        positions.append(plan.seqs[1].start_position)
    assert positions == [0, 15, 30, 45, 60, 75, 90]  # the long prompt advances 15 tokens a step


def test_chunked_prefill_gives_the_same_outputs_as_unchunked() -> None:
    specs = [RequestSpec(f"r{index}", [(7 * index + t) % 23 + 1 for t in range(5 + 11 * index)],
                         SamplingParams(max_tokens=6, n=1 + index % 2), arrival_step=index) for index in range(6)]
    chunked = run_workload(_config(max_num_batched_tokens=8, max_num_seqs=8), specs)
    whole = run_workload(_config(max_num_batched_tokens=512), specs)
    assert all(plan.num_tokens <= 8 for plan in chunked.plans)
    assert max(len(s.token_ids) for plan in chunked.plans for s in plan.seqs) <= 8
    assert max(len(s.token_ids) for plan in whole.plans for s in plan.seqs) > 8
    assert {k: r.completions for k, r in chunked.records.items()} == {k: r.completions for k, r in whole.records.items()}


def test_prefix_cache_hit_computes_only_the_tail() -> None:
    config = _config(block_size=16, num_gpu_blocks=256, max_num_batched_tokens=2048)
    scheduler, worker = Scheduler(config), digest_worker(config)
    prefix = [(t * 31) % 97 + 1 for t in range(1000)]
    scheduler.add_request(_request("first", prefix + [5] * 20, max_tokens=3, ignore_eos=True))
    records = {"first": RequestRecord(), "second": RequestRecord()}
    while scheduler.has_unfinished_requests():
        _step(scheduler, worker, records)
    assert records["first"].cached_prompt_tokens == 0
    before = scheduler.stats()
    scheduler.add_request(_request("second", prefix + [9] * 30, max_tokens=3, ignore_eos=True))
    plan, _ = _step(scheduler, worker, records)
    (seq,) = plan.seqs
    assert seq.start_position == 992  # 62 full blocks of the shared 1000 tokens are reused
    assert len(seq.token_ids) == 1030 - 992
    after = scheduler.stats()
    assert after.num_prefix_cache_queries - before.num_prefix_cache_queries == (1030 - 1) // 16
    assert after.num_prefix_cache_hits - before.num_prefix_cache_hits == 62
    while scheduler.has_unfinished_requests():
        _step(scheduler, worker, records)
    assert records["second"].cached_prompt_tokens == 992


def test_identical_prompt_recomputes_its_last_block() -> None:
    config = _config(block_size=4)
    scheduler, worker = Scheduler(config), digest_worker(config)
    prompt = list(range(1, 13))  # 3 full blocks
    scheduler.add_request(_request("a", prompt, max_tokens=1))
    _step(scheduler, worker)
    scheduler.add_request(_request("b", prompt, max_tokens=1))
    plan, _ = _step(scheduler, worker)
    assert (plan.seqs[0].start_position, len(plan.seqs[0].token_ids)) == (8, 4)


def test_prefix_caching_disabled_reuses_nothing() -> None:
    config = _config(enable_prefix_caching=False)
    specs = [RequestSpec("a", list(range(1, 30)), SamplingParams(max_tokens=2)),
             RequestSpec("b", list(range(1, 30)), SamplingParams(max_tokens=2), arrival_step=3)]
    result = run_workload(config, specs)
    assert result.records["b"].cached_prompt_tokens == 0
    assert result.scheduler.stats().num_prefix_cache_hits == 0
    assert result.scheduler.stats().gpu.num_cached == 0


def test_parallel_samples_share_the_prompt_blocks() -> None:
    config = _config(block_size=16, num_gpu_blocks=256, max_num_batched_tokens=1024)
    scheduler, worker = Scheduler(config), digest_worker(config)
    scheduler.add_request(_request("n4", [(t * 7) % 50 + 1 for t in range(512)], n=4, max_tokens=40,
                                   ignore_eos=True, temperature=1.0, seed=3))
    plan, _ = _step(scheduler, worker)
    assert [(s.start_position, len(s.token_ids), s.sample) for s in plan.seqs] == [(0, 511, None)]
    plan, _ = _step(scheduler, worker)
    assert [(s.start_position, len(s.token_ids)) for s in plan.seqs] == [(511, 1)] * 4
    assert sorted(s.sample.output_index for s in plan.seqs) == [0, 1, 2, 3]
    assert len(plan.blocks_to_copy) == 3  # three samples copy the shared partial block
    for _ in range(30):
        _step(scheduler, worker)
        group = scheduler.group_of("n4")
        num_own = sum(len(seq.block_table) - 31 for seq in group.seqs)
        assert scheduler.num_blocks_of_request("n4") == 31 + num_own  # only the prompt's full blocks shared
        assert scheduler.num_blocks_of_request("n4") < 4 * len(group.seqs[0].block_table)


def test_prompt_of_one_token_forks_immediately() -> None:
    result = run_workload(_config(), [RequestSpec("one", [7], SamplingParams(n=3, max_tokens=4, temperature=1.0))])
    assert sorted(result.records["one"].completions) == [0, 1, 2]
    first = result.plans[0]
    assert [(s.start_position, len(s.token_ids)) for s in first.seqs] == [(0, 1)] * 3


@pytest.mark.parametrize(("prompt_len", "sampling", "config", "reason"), [
    (0, {}, {}, "empty"),
    (10, {"max_tokens": 100}, {"max_model_len": 64}, "max_model_len"),
    (60, {"max_tokens": 10}, {"num_gpu_blocks": 16, "block_size": 4}, "KV blocks"),
    (5, {"n": 20}, {"max_num_seqs": 16}, "max_num_seqs"),
    (5, {"max_tokens": 0}, {}, "max_tokens"),
    (9, {"beam_width": 4, "max_tokens": 8}, {"num_gpu_blocks": 12, "block_size": 2}, "KV blocks"),
])
def test_requests_that_can_never_run_are_rejected(prompt_len, sampling, config, reason) -> None:
    scheduler = Scheduler(_config(**config))
    with pytest.raises(RequestRejected) as raised:
        scheduler.add_request(_request("x", list(range(1, prompt_len + 1)), **sampling))
    assert reason in raised.value.reason
    assert not scheduler.has_unfinished_requests()


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = Scheduler(_config())
    scheduler.add_request(_request("x", [1, 2]))
    with pytest.raises(RequestRejected):
        scheduler.add_request(_request("x", [1, 2]))


def test_abort_frees_blocks_at_once_and_ignores_the_step_in_flight() -> None:
    config = _config()
    scheduler, worker = Scheduler(config), digest_worker(config)
    scheduler.add_request(_request("a", list(range(1, 30)), max_tokens=10, n=2, temperature=1.0))
    _step(scheduler, worker)
    step = scheduler.schedule()
    assert scheduler.stats().gpu.num_used > 0
    assert scheduler.abort_request("a")
    assert scheduler.stats().gpu.num_used == 0
    assert not scheduler.abort_request("a")
    assert scheduler.process_result(step, worker.run(step.plan)) == []
    scheduler.check_invariants()
    assert scheduler.schedule() is None
    assert not scheduler.has_unfinished_requests()


def test_finish_completion_ends_one_sample() -> None:
    config = _config()
    scheduler, worker = Scheduler(config), digest_worker(config)
    scheduler.add_request(_request("a", list(range(1, 10)), max_tokens=6, n=2, temperature=1.0, ignore_eos=True))
    records = {"a": RequestRecord()}
    for _ in range(3):
        _step(scheduler, worker, records)
    used = scheduler.stats().gpu.num_used
    assert scheduler.finish_completion("a", 1)
    assert not scheduler.finish_completion("a", 1)
    assert not scheduler.finish_completion("a", 5)
    assert scheduler.stats().gpu.num_used < used
    scheduler.check_invariants()
    plan, outputs = _step(scheduler, worker, records)
    assert len(plan.seqs) == 1
    assert outputs[0].deltas[0].index == 1 and outputs[0].deltas[0].finish_reason is FinishReason.ABORT
    while scheduler.has_unfinished_requests():
        _step(scheduler, worker, records)
    assert records["a"].is_finished
    assert len(records["a"].completions[0].token_ids) == 6
    assert records["a"].completions[1].finish_reason is FinishReason.ABORT


def test_finishing_the_last_completion_finishes_the_request() -> None:
    config = _config()
    scheduler, worker = Scheduler(config), digest_worker(config)
    scheduler.add_request(_request("a", [1, 2, 3], max_tokens=6))
    _step(scheduler, worker)
    assert scheduler.finish_completion("a", 0)
    assert not scheduler.has_unfinished_requests()
    (output,) = scheduler.pop_pending_outputs()
    assert output.is_finished and output.deltas[0].finish_reason is FinishReason.ABORT
    assert scheduler.stats().gpu.num_used == 0


def test_stops_min_tokens_and_sample_specs() -> None:
    config = _config()
    scheduler = Scheduler(config)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[7],
                                                                 temperature=0.5, seed=11, logprobs=2,
                                                                 presence_penalty=0.5),
                                  eos_token_ids=[0, 5]))
    tokens = [0, 9, 7]  # EOS is suppressed for the first two outputs; 7 stops the third
    outputs = []
    for token in tokens:
        step = scheduler.schedule()
        (seq,) = step.plan.seqs
        spec = seq.sample
        assert (spec.seed, spec.temperature, spec.num_logprobs, spec.presence_penalty) == (11, 0.5, 2, 0.5)
        num_outputs = len(outputs)
        assert spec.suppress_token_ids == ([0, 5, 7] if num_outputs < 2 else [])
        assert spec.prompt_token_ids == [1, 2, 3]
        assert spec.output_token_ids == tokens[:num_outputs]
        sample = SeqSample(seq.seq_id, token, -0.5, top_token_ids=[token, 4], top_logprobs=[-0.5, -1.0])
        outputs += scheduler.process_result(step, StepResult(step.plan.step_id, [sample]))
    deltas = [output.deltas[0] for output in outputs]
    assert [d.token_ids for d in deltas] == [[0], [9], [7]]  # EOS counts as a token before min_tokens
    assert [d.finish_reason for d in deltas] == [None, None, FinishReason.STOP]
    assert deltas[2].cumulative_logprob == pytest.approx(-1.5)
    assert deltas[0].logprobs[0].top_token_ids == [0, 4]
    assert outputs[-1].is_finished


def test_ignore_eos_and_max_tokens() -> None:
    config = _config()
    scheduler = Scheduler(config)
    scheduler.add_request(_request("a", [1, 2], max_tokens=2, ignore_eos=True))
    reasons = []
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        assert step.plan.seqs[0].sample.suppress_token_ids == []
        outputs = scheduler.process_result(step, StepResult(step.plan.step_id, [SeqSample(step.plan.seqs[0].seq_id, 0, 0.0)]))
        reasons.append(outputs[0].deltas[0].finish_reason)
    assert reasons == [None, FinishReason.LENGTH]


def test_step_ids_and_ordering_errors() -> None:
    config = _config()
    scheduler, worker = Scheduler(config), digest_worker(config)
    assert scheduler.schedule() is None
    scheduler.add_request(_request("a", [1, 2, 3], max_tokens=3, ignore_eos=True))
    step = scheduler.schedule()
    assert step.plan.step_id == 1
    with pytest.raises(StepOrderError):
        scheduler.schedule()
    with pytest.raises(StepOrderError):
        scheduler.process_result(step, StepResult(step_id=99))
    with pytest.raises(StepOrderError):
        scheduler.process_result(step, StepResult(step_id=1))  # the sample is missing
    scheduler.reset()
    step = scheduler.schedule()
    assert (step.plan.step_id, step.plan.epoch) == (2, 1)
    scheduler.process_result(step, worker.run(step.plan))
    assert scheduler.schedule().plan.step_id == 3


def test_reset_recomputes_from_held_tokens_without_repeating_outputs() -> None:
    specs = [RequestSpec(f"r{i}", list(range(1 + i, 20 + 3 * i)), SamplingParams(max_tokens=8, n=1 + i % 2,
                                                                               temperature=1.0, seed=i))
             for i in range(4)]
    specs.append(RequestSpec("beam", list(range(2, 15)), SamplingParams(max_tokens=6, beam_width=2)))
    reference = run_workload(_config(), specs)
    config = _config()
    scheduler, worker = Scheduler(config), digest_worker(config)
    records = {spec.request_id: RequestRecord() for spec in specs}
    for spec in specs:
        scheduler.add_request(spec.request())
    for _ in range(4):
        _step(scheduler, worker, records)
    in_flight = scheduler.schedule()
    scheduler.reset()
    scheduler.check_invariants()
    num_unfinished = sum(1 for spec in specs if not records[spec.request_id].is_finished)
    assert scheduler.stats().gpu.num_used == 0 and scheduler.stats().num_waiting == num_unfinished == 4
    assert scheduler.process_result(in_flight, worker.run(in_flight.plan)) == []  # stale epoch
    worker = digest_worker(config)  # restarted workers: no KV survives
    while scheduler.has_unfinished_requests():
        _step(scheduler, worker, records)
    assert {k: r.completions for k, r in records.items()} == {k: r.completions for k, r in reference.records.items()}
