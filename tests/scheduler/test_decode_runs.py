"""Decode runs (StepPlan.num_steps > 1, scheduler/core/continuable.py): a run plan asks a
single-rank worker for several steps at once, within the blocks each sequence holds (its next one
taken ahead near a block's end) and max_tokens,
answered in one result when every request takes its whole answer at the end, else each step as it
comes (StepPlan.streams_steps) and then a result that ends the run. Applied, a run gives the same
tokens, finish reasons, log probabilities and cached blocks as the same steps planned one by one
(as for a two-rank replica, which has no runs), with the block pool's invariants holding after
every step; a streamed request gets each token in the step that sampled it; a token that ends a
sequence drops the run's later tokens."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.contracts.request_types import FinishReason, Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.contracts.step_plan import SeqSample, StepPlan, StepResult
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.continuable import MAX_RUN_STEPS
from pagedserve.scheduler.core.errors import StepOrderError
from pagedserve.scheduler.core.scheduler import Scheduler

BLOCK_SIZE = 4
EOS = 2


def _scheduler(**config) -> Scheduler:
    config = {"block_size": BLOCK_SIZE, "max_num_seqs": 4, **config}
    return Scheduler(SchedulerConfig(num_gpu_blocks=64, max_model_len=256,
                                     max_num_batched_tokens=256, **config))


def _request(request_id: str, prompt: list[int], hold: bool, **sampling) -> Request:
    sampling = {"max_tokens": 10, "ignore_eos": True, "logprobs": 1, **sampling}
    return Request(request_id, prompt, SamplingParams(**sampling), eos_token_ids=[EOS], hold_output=hold)


def _token(seq_id_tokens: list[int], position: int, eos_at: int | None) -> int:
    """The fake model: the token at `position` depends on the sequence's tokens and the position."""
    if position == eos_at:
        return EOS
    return 10 + (sum(seq_id_tokens) * 31 + position * 7) % 40


def _worker(plan: StepPlan, tokens_of: dict[int, list[int]], eos_at: int | None,
            block_size: int = BLOCK_SIZE) -> StepResult:
    """Every step of the plan (a run's too) as a single-rank worker computes it: each sequence one
    position on with the token the step before sampled; a run ends after a step that sampled one
    of the plan's end tokens (worker/continuation.py)."""
    samples = []
    contexts = {seq.seq_id: list(tokens_of[seq.seq_id][:seq.context_len]) for seq in plan.seqs}
    num_steps = 0
    while num_steps < plan.num_steps:
        step_tokens = []
        for seq in plan.seqs:
            context = contexts[seq.seq_id]
            assert seq.context_len + num_steps <= len(seq.block_table) * block_size  # the run stays in its blocks
            token = _token(context, len(context), eos_at)
            samples.append(SeqSample(seq.seq_id, token, -0.25 - 0.01 * len(context), [token], [-0.1]))
            context.append(token)
            step_tokens.append(token)
        num_steps += 1
        if any(token in plan.end_token_ids for token in step_tokens):
            break
    return StepResult(plan.step_id, samples, epoch=plan.epoch, num_steps=num_steps)


def _streamed(result: StepResult, num_seqs: int) -> list[StepResult]:
    """A run's result as a worker streams it: each step's, then the one that ends the run."""
    steps = [dataclasses.replace(result, samples=result.samples[index * num_seqs:(index + 1) * num_seqs],
                                 num_steps=1, run_step=index + 1) for index in range(result.num_steps)]
    return steps + [StepResult(result.step_id, [], epoch=result.epoch, num_steps=result.num_steps)]


def _serve(requests: list[Request], eos_at: int | None = None, max_steps: int = 200, **config):
    """Runs the requests to their end; returns (outputs by request id, plans, cached block count)."""
    scheduler = _scheduler(**config)
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list] = {request.request_id: [] for request in requests}
    plans = []
    for _ in range(max_steps):
        step = scheduler.schedule()
        if step is None:
            break
        plans.append(step.plan)
        tokens_of = {seq.seq_id: seq.token_ids for group in step.groups for seq in group.seqs}
        result = _worker(step.plan, tokens_of, eos_at)
        if step.plan.streams_steps:
            *steps, result = _streamed(result, len(step.plan.seqs))
            for streamed_step in steps:
                for output in scheduler.process_run_step(step, streamed_step):
                    outputs[output.request_id].append(output)
                scheduler.check_invariants()
        for output in scheduler.process_result(step, result):
            outputs[output.request_id].append(output)
        scheduler.check_invariants()
    assert not scheduler.has_unfinished_requests()
    return outputs, plans, scheduler.block_manager.gpu_pool.num_cached


def _one_by_one(requests: list[Request], eos_at: int | None = None, **config):
    """The same requests planned one step at a time (a two-rank replica has no runs)."""
    return _serve(requests, eos_at, num_kv_ranks=2, **config)


def _joined(outputs) -> tuple:
    deltas = [delta for output in outputs for delta in output.deltas]
    return ([t for delta in deltas for t in delta.token_ids],
            [(lp.token_id, lp.logprob) for delta in deltas for lp in delta.logprobs],
            deltas[-1].cumulative_logprob, deltas[-1].finish_reason, outputs[-1].is_finished)


def test_a_request_runs_across_its_block_ends_to_the_token_before_its_last_with_the_same_tokens():
    prompt = [5, 6, 7, 8, 9, 11]  # decodes at positions 6 .. 14 for 10 outputs
    held, plans, held_cached = _serve([_request("a", prompt, hold=True)])
    streamed, streamed_plans, streamed_cached = _serve([_request("a", prompt, hold=False)])
    plain, plain_plans, plain_cached = _one_by_one([_request("a", prompt, hold=False)])
    assert _joined(held["a"]) == _joined(streamed["a"]) == _joined(plain["a"])
    assert _joined(held["a"])[3] is FinishReason.LENGTH and len(_joined(held["a"])[0]) == 10
    # the prefill, then a run over positions 6-11 (the block of 8-11 taken ahead with the plan at
    # 6) and one to the token before the last (12-13); the last token alone, in a plan whose next
    # step the worker must not compute
    shapes = [(0, 1), (6, 6), (12, 2), (14, 1)]
    assert [(plan.seqs[0].start_position, plan.num_steps) for plan in plans] == shapes
    assert [(plan.seqs[0].start_position, plan.num_steps) for plan in streamed_plans] == shapes
    assert [len(plan.seqs[0].block_table) for plan in plans] == [2, 3, 4, 4]
    assert [plan.continuable for plan in plans[1:]] == [True, True, False]
    assert not any(plan.streams_steps for plan in plans)
    assert [plan.streams_steps for plan in streamed_plans] == [False, True, True, False]
    # held: one output per run; streamed: one per token, as each step comes
    assert [len(output.deltas[0].token_ids) for output in held["a"]] == [1, 6, 2, 1]
    assert [len(output.deltas[0].token_ids) for output in streamed["a"]] == [1] * 10
    assert len(plain_plans) == 10 and all(plan.num_steps == 1 for plan in plain_plans)
    assert held_cached == streamed_cached == plain_cached == 3  # blocks filled in runs are registered


@pytest.mark.parametrize("ignore_eos, stop_token_ids, expected", [
    (True, [], []), (False, [], [EOS]), (True, [7, 5], [5, 7]), (False, [7], [EOS, 7])])
def test_a_continuable_plan_names_the_tokens_that_may_end_its_sequences(ignore_eos, stop_token_ids, expected):
    """EOS unless ignored, and the stop tokens: the worker computes nothing ahead after one of them;
    a plan that is not continuable (the prefill) names none."""
    _, plans, _ = _serve([_request("a", [5, 6, 7, 8, 9, 11], hold=True, ignore_eos=ignore_eos,
                                   stop_token_ids=stop_token_ids)])
    assert [plan.end_token_ids for plan in plans if plan.continuable] == [expected] * 2
    assert plans[0].end_token_ids == [] and not plans[0].continuable


def test_a_run_ends_after_a_step_that_sampled_an_end_token_and_the_answer_is_the_same():
    """The run from position 6 is asked for 6 steps; EOS sampled at 8 (the token at 9) ends it after
    3 (worker side), and the answer equals the one planned step by step."""
    prompt = [5, 6, 7, 8, 9, 11]
    held, plans, _ = _serve([_request("a", prompt, hold=True, ignore_eos=False)], eos_at=9)
    streamed, streamed_plans, _ = _serve([_request("a", prompt, hold=False, ignore_eos=False)], eos_at=9)
    plain, _, _ = _one_by_one([_request("a", prompt, hold=False, ignore_eos=False)], eos_at=9)
    assert _joined(held["a"]) == _joined(streamed["a"]) == _joined(plain["a"])
    assert [(plan.seqs[0].start_position, plan.num_steps) for plan in plans] == [(0, 1), (6, 6)]
    assert [(plan.seqs[0].start_position, plan.num_steps) for plan in streamed_plans] == [(0, 1), (6, 6)]
    assert len(_joined(held["a"])[0]) == 4


def test_a_run_never_exceeds_the_step_limit():
    scheduler = _scheduler(block_size=32)
    scheduler.add_request(_request("a", list(range(5, 11)), hold=True, max_tokens=40))
    step = scheduler.schedule()
    scheduler.process_result(step, _worker(step.plan, {step.plan.seqs[0].seq_id: list(range(5, 11))}, None, 32))
    assert scheduler.schedule().plan.num_steps == MAX_RUN_STEPS


@pytest.mark.parametrize("eos_at", [9, 10, 14])  # inside a run, at its first step, at the last output
def test_a_token_that_ends_a_sequence_drops_the_rest_of_its_run(eos_at):
    prompt = [5, 6, 7, 8, 9, 11]
    held, _, held_cached = _serve([_request("a", prompt, hold=True, ignore_eos=False)], eos_at=eos_at)
    streamed, _, streamed_cached = _serve([_request("a", prompt, hold=False, ignore_eos=False)], eos_at=eos_at)
    plain, _, plain_cached = _one_by_one([_request("a", prompt, hold=False, ignore_eos=False)], eos_at=eos_at)
    assert _joined(held["a"]) == _joined(streamed["a"]) == _joined(plain["a"])
    assert streamed_cached == plain_cached
    tokens, _, _, reason, _ = _joined(held["a"])
    assert tokens[-1] == EOS and len(tokens) == eos_at - len(prompt) + 1 and reason is FinishReason.STOP
    assert held_cached == plain_cached


def test_a_batch_runs_streamed_when_any_request_streams_and_each_gets_its_own_tokens():
    prompts = {"a": [5, 6, 7, 8, 9], "b": [21, 22, 23, 24, 25, 26, 27, 28, 29]}
    requests = [_request(name, prompt, hold=True, max_tokens=9) for name, prompt in prompts.items()]
    held, plans, _ = _serve(requests)
    plain, plain_plans, _ = _one_by_one(requests)
    for name in prompts:
        assert _joined(held[name]) == _joined(plain[name])
    assert any(plan.num_steps > 1 and len(plan.seqs) == 2 for plan in plans) and len(plans) < len(plain_plans) / 2
    assert not any(plan.streams_steps for plan in plans)
    mixed, mixed_plans, _ = _serve([requests[0], dataclasses.replace(requests[1], hold_output=False)])
    runs = [plan for plan in mixed_plans if plan.num_steps > 1 and len(plan.seqs) == 2]
    assert runs and all(plan.streams_steps for plan in runs)
    for name in prompts:
        assert _joined(mixed[name]) == _joined(plain[name])
    assert all(len(output.deltas[0].token_ids) == 1 for output in mixed["b"])


def test_a_run_of_more_sequences_than_a_step_computed_ahead_ends_with_the_first_answer_to_end():
    """Whole answers of different lengths in a batch too large for a step computed ahead: a run
    goes up to the earliest answer's last token (no plan of that token alone), and every answer is
    the one planned step by step, with the same cached blocks."""
    from pagedserve.scheduler.core.continuable import MAX_CONTINUABLE_SEQS

    lengths = [6, 9, 10, 13, 15, 16]
    assert len(lengths) > MAX_CONTINUABLE_SEQS
    requests = [_request(f"r{index}", [5 + index, 6, 7, 8, 9], hold=True, max_tokens=max_tokens)
                for index, max_tokens in enumerate(lengths)]
    held, plans, held_cached = _serve(requests, max_num_seqs=8)
    plain, plain_plans, plain_cached = _one_by_one(requests, max_num_seqs=8)
    for request in requests:
        assert _joined(held[request.request_id]) == _joined(plain[request.request_id])
    assert held_cached == plain_cached
    decodes = [plan for plan in plans if all(len(seq.token_ids) == 1 for seq in plan.seqs)]
    large = [plan for plan in decodes if len(plan.seqs) > MAX_CONTINUABLE_SEQS]
    assert large and not any(plan.continuable for plan in large)
    # each large batch's run ends with its first answer's last token: after the prefill (1 token),
    # the run of 5 ends r0 (6 tokens) and the next one of 3 ends r1 (9); no last token alone
    assert [(len(plan.seqs), plan.num_steps) for plan in large] == [(6, 5), (5, 3)]
    finished_in_runs = [output for outputs in held.values() for output in outputs
                        if output.is_finished and len(output.deltas[0].token_ids) > 1]
    assert {output.request_id for output in finished_in_runs} >= {"r0", "r1"}


def test_no_runs_with_several_ranks_and_a_result_that_does_not_fit_its_run_is_refused():
    scheduler = _scheduler(num_kv_ranks=2)
    scheduler.add_request(_request("a", [5, 6, 7, 8, 9, 11], hold=True))
    step = scheduler.schedule()
    scheduler.process_result(step, _worker(step.plan, {step.plan.seqs[0].seq_id: [5, 6, 7, 8, 9, 11]}, None))
    assert scheduler.schedule().plan.num_steps == 1

    scheduler = _scheduler()
    scheduler.add_request(_request("a", [5, 6, 7, 8], hold=True))
    step = scheduler.schedule()
    tokens = {step.plan.seqs[0].seq_id: [5, 6, 7, 8]}
    scheduler.process_result(step, _worker(step.plan, tokens, None))
    step = scheduler.schedule()
    assert step.plan.num_steps == 8  # positions 4-11: the block of 8-11 taken ahead
    result = _worker(step.plan, {step.plan.seqs[0].seq_id: [5, 6, 7, 8, 10]}, None)
    too_many = dataclasses.replace(result, samples=result.samples + result.samples[-1:], num_steps=9)
    with pytest.raises(StepOrderError):
        scheduler.process_result(step, too_many)


def _run_in_flight(hold: bool = False):
    """A scheduler whose step in flight is an 8-step run of request "a" (positions 4-11, streamed
    unless held), with its worker result."""
    prompt = [5, 6, 7, 8]
    scheduler = _scheduler()
    scheduler.add_request(_request("a", prompt, hold=hold))
    step = scheduler.schedule()
    seq_id = step.plan.seqs[0].seq_id
    scheduler.process_result(step, _worker(step.plan, {seq_id: prompt}, None))
    step = scheduler.schedule()
    assert step.plan.num_steps == 8 and step.plan.streams_steps is not hold
    return scheduler, step, _worker(step.plan, {seq_id: list(scheduler.group_of("a").seqs[0].token_ids)}, None)


def test_a_shorter_run_than_planned_is_applied_as_far_as_it_went():
    """The worker ends a run early when a step fails or cannot be derived: the steps it computed count."""
    scheduler, step, result = _run_in_flight(hold=True)
    (output,) = scheduler.process_result(step, dataclasses.replace(result, samples=result.samples[:2], num_steps=2))
    assert len(output.deltas) == 1 and len(output.deltas[0].token_ids) == 2 and step.num_decode_tokens == 2
    scheduler.check_invariants()
    following = scheduler.schedule().plan
    assert (following.seqs[0].start_position, following.num_steps) == (6, 6)  # to the block held ahead's end


def test_streamed_steps_out_of_order_or_a_wrong_end_are_refused():
    scheduler, step, result = _run_in_flight()
    first, second, *_, end = _streamed(result, 1)
    with pytest.raises(StepOrderError):
        scheduler.process_run_step(step, second)  # before the first
    scheduler, step, result = _run_in_flight()
    scheduler.process_run_step(step, first)
    with pytest.raises(StepOrderError):
        scheduler.process_run_step(step, first)  # the first again
    scheduler, step, result = _run_in_flight()
    for streamed_step in (first, second):
        scheduler.process_run_step(step, streamed_step)
    with pytest.raises(StepOrderError):
        scheduler.process_result(step, end)  # ends a run of 8 after 2 streamed steps
    scheduler, step, result = _run_in_flight(hold=True)
    with pytest.raises(StepOrderError):
        scheduler.process_run_step(step, first)  # the plan does not stream its steps


def test_a_streamed_run_ended_early_counts_its_steps_and_a_run_answered_at_once_is_applied_too():
    scheduler, step, result = _run_in_flight()
    first, second, *_ = _streamed(result, 1)
    outputs = scheduler.process_run_step(step, first) + scheduler.process_run_step(step, second)
    assert [output.deltas[0].token_ids for output in outputs] == [[sample.token_id] for sample in result.samples[:2]]
    assert scheduler.process_result(step, StepResult(step.plan.step_id, [], epoch=step.plan.epoch, num_steps=2)) == []
    assert step.num_decode_tokens == 2
    scheduler.check_invariants()
    assert scheduler.schedule().plan.seqs[0].start_position == 6
    scheduler, step, result = _run_in_flight()  # the worker may answer a streamed run's plan in one result
    (output,) = scheduler.process_result(step, result)
    assert output.deltas[0].token_ids == [sample.token_id for sample in result.samples]
    scheduler.check_invariants()
