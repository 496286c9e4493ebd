"""Computing the likely next step ahead (worker/continuation.py), as the worker's step loop does:
the same tokens and log probabilities, bit for bit, as running every plan when it arrives, with
steps that match the computed one and steps that do not (a sequence that finished, whose block is
then reused by a new one); a decode run (several steps of a continuable plan in a row) gives each
step's samples bit for bit too, in one result or each step as it is computed; and the rules of next_plan and is_same_step."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import make_prompts
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, SeqFailure, SeqSample, StepPlan, StepResult
from pagedserve.worker.continuation import is_same_step, next_plan, run_steps
from pagedserve.worker.model_runner import ModelRunner

NUM_BLOCKS = 48
BLOCK_SIZE = 8


class AheadRunner:
    """The worker's step loop around a ModelRunner: each plan the driver sends is answered from the
    step computed ahead when it is that step; after each, the next step is computed ahead. Decode
    plans are marked continuable as the scheduler marks them (every sequence one sampled token)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.ahead: tuple[StepPlan, StepResult] | None = None
        self.num_hits = self.num_misses = 0

    def execute(self, plan: StepPlan) -> StepResult:
        plan.continuable = all(len(seq.token_ids) == 1 and seq.sample is not None for seq in plan.seqs)
        ahead, self.ahead = self.ahead, None
        if ahead is not None and is_same_step(ahead[0], plan):
            self.num_hits += 1
            result = ahead[1]
        else:
            self.num_misses += ahead is not None
            result = self.runner.execute(plan)
        following = next_plan(plan, result, self.block_size)
        if following is not None:
            self.ahead = following, self.runner.execute(following)
        return result


def _runner(path, dtype: str) -> ModelRunner:
    runner = ModelRunner(path, device="cpu", dtype=dtype, block_size=BLOCK_SIZE, seed=7)
    runner.load()
    runner.init_cache(NUM_BLOCKS, 0)
    return runner


def _serve(driver: PlanDriver) -> list[list[int]]:
    """Three sequences (greedy, seeded sampling, logprobs) of different lengths; when the shortest
    finishes, its blocks go back to the free list and a fourth sequence's prefill takes them."""
    prompts = make_prompts(seed=11, lengths=(5, 9, 14, 6))
    specs = [SampleSpec(), SampleSpec(temperature=0.9, top_p=0.9, seed=5), SampleSpec(num_logprobs=2),
             SampleSpec(temperature=0.7, seed=9)]
    seqs = [DrivenSeq(i, prompt, max_new_tokens, spec=spec)
            for i, (prompt, max_new_tokens, spec) in enumerate(zip(prompts, (6, 13, 17, 9), specs))]
    active, late = seqs[:3], seqs[3]
    for seq in active:
        driver.step([(seq, seq.num_pending)])
    while active:
        driver.step([(seq, 1) for seq in active])
        for seq in [seq for seq in active if seq.is_finished]:
            active.remove(seq)
            driver.free(seq)
            if late is not None:
                driver.step([(late, late.num_pending)])
                active.append(late)
                late = None
    return [seq.generated for seq in seqs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_computed_ahead_give_the_plans_results_bit_for_bit(checkpoint_dir, dtype):
    path = checkpoint_dir("llama-gqa-untied")
    plain = PlanDriver(_runner(path, dtype), NUM_BLOCKS)
    ahead_runner = AheadRunner(_runner(path, dtype))
    ahead = PlanDriver(ahead_runner, NUM_BLOCKS)
    assert _serve(ahead) == _serve(plain)
    assert [result.samples for result in ahead.results] == [result.samples for result in plain.results]
    assert ahead_runner.num_hits >= 8 and ahead_runner.num_misses >= 2  # a finish, a new sequence


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_run_gives_each_steps_samples_bit_for_bit(checkpoint_dir, dtype):
    """Three sequences (greedy, seeded sampling, logprobs) prefilled alike on two runners; one
    answers a run of 6 steps, the other the same steps one plan at a time. The run ends where the
    first sequence's block does (3 steps); a step that fails ends it before that step, and so does a
message from the scheduler waiting (EndRun)."""
    path = checkpoint_dir("llama-gqa-untied")
    prompts = make_prompts(seed=12, lengths=(5, 10, 3))
    specs = [SampleSpec(), SampleSpec(temperature=0.9, top_p=0.9, seed=5), SampleSpec(num_logprobs=2)]
    drivers = []
    for _ in range(2):
        driver = PlanDriver(_runner(path, dtype), NUM_BLOCKS)
        seqs = [DrivenSeq(i, prompt, 20, spec=spec) for i, (prompt, spec) in enumerate(zip(prompts, specs))]
        for seq in seqs:
            driver.step([(seq, seq.num_pending)])
        drivers.append((driver, seqs))
    (plain, plain_seqs), (runner_driver, seqs) = drivers
    for _ in range(3):  # positions 5, 6, 7 of the first sequence: its block ends there
        plain.step([(seq, 1) for seq in plain_seqs])
    runner_driver.step([(seq, 1) for seq in seqs])
    plan = dataclasses.replace(runner_driver.plans[-1], continuable=True, num_steps=6)
    first = runner_driver.results[-1]
    runner = runner_driver.runner
    result, last, last_result = run_steps(first, plan, BLOCK_SIZE, runner.execute, lambda: False)
    assert result.num_steps == 3 and result.step_id == plan.step_id
    assert result.samples == [sample for step in plain.results[-3:] for sample in step.samples]
    assert last.seqs[0].start_position == 7 and last_result.samples == plain.results[-1].samples

    calls = []

    def failing_second(step: StepPlan):
        calls.append(step.seqs[0].start_position)
        return None if len(calls) == 2 else runner.execute(step)

    result, last, _ = run_steps(first, plan, BLOCK_SIZE, failing_second, lambda: False)
    assert result.num_steps == 2 and calls == [6, 7] and last.seqs[0].start_position == 6
    assert result.samples == [sample for step in plain.results[-3:-1] for sample in step.samples]
    single, last, _ = run_steps(first, dataclasses.replace(plan, num_steps=1), BLOCK_SIZE, runner.execute,
                                lambda: False)
    assert single is first and last.num_steps == 1
    checks = []  # a message from the scheduler (EndRun) waits after the second step: the run ends there
    result, last, _ = run_steps(first, plan, BLOCK_SIZE, runner.execute, lambda: checks.append(1) or len(checks) > 1)
    assert result.num_steps == 2 and last.seqs[0].start_position == 6
    assert result.samples == [sample for step in plain.results[-3:-1] for sample in step.samples]

    # a run that streams its steps: each step's result goes out as it is computed, then the end
    sent = []
    streamed = dataclasses.replace(plan, streams_steps=True)
    end, last, last_result = run_steps(first, streamed, BLOCK_SIZE, runner.execute, lambda: False, sent.append)
    assert [step.run_step for step in sent] == [1, 2, 3] and all(step.step_id == plan.step_id for step in sent)
    assert [step.samples for step in sent] == [step.samples for step in plain.results[-3:]]
    assert (end.run_step, end.samples, end.num_steps, end.step_id) == (0, [], 3, plan.step_id)
    assert end.forward_seconds == sum(step.forward_seconds for step in sent)
    assert last.seqs[0].start_position == 7 and last_result.samples == plain.results[-1].samples
    sent.clear()
    calls.clear()
    end, _, _ = run_steps(first, streamed, BLOCK_SIZE, failing_second, lambda: False, sent.append)
    assert [step.run_step for step in sent] == [1, 2] and end.num_steps == 2 and not end.samples
    sent.clear()  # the same plan without streams_steps answers in one result, whatever the caller passes
    result, _, _ = run_steps(first, plan, BLOCK_SIZE, runner.execute, lambda: False, sent.append)
    assert not sent and result.num_steps == 3


def _decode_plan(**changes) -> StepPlan:
    seqs = [ScheduledSeq(1, [40], 5, [3, 8], SampleSpec()), ScheduledSeq(2, [41], 9, [4, 6, 9], SampleSpec(seed=3))]
    return dataclasses.replace(StepPlan(step_id=7, seqs=seqs, epoch=2, continuable=True), **changes)


def _result(plan: StepPlan, **changes) -> StepResult:
    samples = [SeqSample(seq.seq_id, 100 + seq.seq_id, -0.5) for seq in plan.seqs]
    return dataclasses.replace(StepResult(step_id=plan.step_id, samples=samples, epoch=plan.epoch), **changes)


def test_next_plan_feeds_each_sampled_token_one_position_on():
    plan = _decode_plan()
    following = next_plan(plan, _result(plan), block_size=4)
    assert (following.step_id, following.epoch, following.continuable) == (8, 2, True)
    assert [(seq.seq_id, seq.token_ids, seq.start_position, seq.block_table, seq.sample) for seq in following.seqs] == [
        (1, [101], 6, [3, 8], SampleSpec()), (2, [102], 10, [4, 6, 9], SampleSpec(seed=3))]
    assert is_same_step(following, dataclasses.replace(following, seqs=[dataclasses.replace(seq) for seq in following.seqs]))


def test_no_step_ahead_where_the_next_one_is_not_known():
    plan = _decode_plan()
    assert next_plan(dataclasses.replace(plan, continuable=False), _result(plan), 4) is None
    assert next_plan(plan, _result(plan, failures=[SeqFailure(2, "x")]), 4) is None
    assert next_plan(plan, _result(plan, samples=_result(plan).samples[:1]), 4) is None
    assert next_plan(plan, _result(plan), block_size=3) is None  # sequence 2's next position starts a block
    lora = _decode_plan(seqs=[dataclasses.replace(seq, lora_slot=0) for seq in plan.seqs])
    assert next_plan(lora, _result(lora), 4) is None


def test_nothing_is_derived_after_a_token_that_may_end_a_sequence():
    """A step that sampled one of the plan's end tokens (sequence 2 samples 102) has no step after
    it, ahead or in a run; other end tokens do not stop it, and the derived step keeps the set."""
    plan = _decode_plan(end_token_ids=[0, 102])
    assert next_plan(plan, _result(plan), 4) is None
    other = _decode_plan(end_token_ids=[0, 7])
    assert next_plan(other, _result(other), 4).end_token_ids == [0, 7]
    steps = []

    def execute(step: StepPlan) -> StepResult:
        steps.append(step.seqs[0].start_position)
        return _result(step)

    run = _decode_plan(num_steps=4, end_token_ids=[102])
    result, last, _ = run_steps(_result(run), run, 4, execute, lambda: False)
    assert (result.num_steps, steps, last is run) == (1, [], True)  # the first step sampled 102: no more
    going_on = _decode_plan(num_steps=3, end_token_ids=[7])
    result, _, _ = run_steps(_result(going_on), going_on, 4, execute, lambda: False)
    assert (result.num_steps, steps) == (3, [6, 7])


def test_a_run_that_is_not_continuable_derives_its_steps_and_nothing_ahead_after_them():
    """A run of more sequences than a step computed ahead takes (continuable False, num_steps > 1):
    its later steps are derived inside the run, into the blocks its plan gives (sequence 1's block
    8 taken ahead), and the last one is not continuable, so the worker computes nothing ahead."""
    run = _decode_plan(continuable=False, num_steps=3)
    assert next_plan(run, _result(run), 4) is None  # no step ahead of a plan that is not continuable
    steps = []

    def execute(step: StepPlan) -> StepResult:
        steps.append([seq.start_position for seq in step.seqs])
        return _result(step)

    result, last, last_result = run_steps(_result(run), run, 4, execute, lambda: False)
    assert (result.num_steps, steps) == (3, [[6, 10], [7, 11]])
    assert not last.continuable and next_plan(last, last_result, 4) is None


@pytest.mark.parametrize("change", [
    dict(step_id=9), dict(epoch=3), dict(blocks_to_copy=[(1, 2)]), dict(masks_follow=True),
    dict(seqs="token"), dict(seqs="position"), dict(seqs="blocks"), dict(seqs="spec"), dict(seqs="order"),
    dict(seqs="fewer")])
def test_a_plan_that_differs_in_anything_is_not_the_step_computed_ahead(change):
    plan = _decode_plan()
    ahead = next_plan(plan, _result(plan), 4)
    seqs = [dataclasses.replace(seq) for seq in ahead.seqs]
    edits = {"token": lambda: setattr(seqs[0], "token_ids", [5]),
             "position": lambda: setattr(seqs[1], "start_position", 11),
             "blocks": lambda: setattr(seqs[1], "block_table", [4, 6, 10]),
             "spec": lambda: setattr(seqs[0], "sample", SampleSpec(temperature=0.5)),
             "order": lambda: seqs.reverse(), "fewer": lambda: seqs.pop()}
    if change.get("seqs"):
        edits[change.pop("seqs")]()
    arrived = dataclasses.replace(ahead, seqs=seqs, **change)
    assert not is_same_step(ahead, arrived)


def test_a_plan_whose_table_goes_on_with_a_block_taken_ahead_is_the_step_computed_ahead():
    """The scheduler may append a sequence's next block to its table (a block ahead) in the plan
    after the one the worker computed ahead from: that step read and wrote none of it."""
    plan = _decode_plan()
    ahead = next_plan(plan, _result(plan), 4)
    seqs = [dataclasses.replace(seq) for seq in ahead.seqs]
    seqs[0].block_table = [*seqs[0].block_table, 11]
    assert is_same_step(ahead, dataclasses.replace(ahead, seqs=seqs))
    seqs[0].block_table = [3, 12]  # not the table it computed with, extended or not
    assert not is_same_step(ahead, dataclasses.replace(ahead, seqs=seqs))
