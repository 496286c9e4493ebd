"""StepPlan.continuable and decode runs (scheduler/core/continuable.py): a plan is a run
(num_steps > 1) exactly when every sequence, at most MAX_RUN_SEQS, decodes one sampled token in a
block it owns alone with room for the next position in the blocks it holds, under a spec its
tokens do not change, with more tokens to go, and nothing waits or is swapped out; continuable
(the worker may compute the next step ahead, worker/continuation.py) when it is also at most
MAX_CONTINUABLE_SEQS. A decode near its block's end takes its next block in the same plan (a
block ahead) when nothing waits and the pool can spare it, so runs cross block boundaries."""

from __future__ import annotations

import dataclasses

from pagedserve.contracts.request_types import Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.contracts.step_plan import SeqSample, StepResult
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.continuable import MAX_RUN_STEPS
from pagedserve.scheduler.core.scheduler import Scheduler

BLOCK_SIZE = 4


def _scheduler(max_num_seqs: int = 4, num_gpu_blocks: int = 64, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, max_model_len=256, block_size=BLOCK_SIZE,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=256, **config))


def _request(request_id: str, prompt_len: int = 6, **sampling) -> Request:
    sampling = {"max_tokens": 10, "ignore_eos": True, **sampling}
    return Request(request_id, list(range(4, 4 + prompt_len)), SamplingParams(**sampling), eos_token_ids=[2])


def _run(scheduler: Scheduler, num_steps: int, add_at: dict[int, Request] | None = None,
         distinct_tokens: bool = False, plans: list | None = None) -> list[tuple[bool, list]]:
    """(continuable, [(seq_id, position of its first new token, number of new tokens)]) per step;
    each step answered as one step (a run's worker may stop after any of its steps); the plans
    appended to `plans`."""
    steps = []
    for index in range(num_steps):
        if add_at and index in add_at:
            scheduler.add_request(add_at[index])
        step = scheduler.schedule()
        if step is None:
            break
        plan = step.plan
        if plans is not None:
            plans.append(plan)
        scheduler.check_invariants()
        steps.append((plan.continuable, [(seq.seq_id, seq.start_position, len(seq.token_ids)) for seq in plan.seqs]))
        scheduler.process_result(step, StepResult(step_id=plan.step_id, epoch=plan.epoch, samples=[
            SeqSample(seq.seq_id, 200 + index if distinct_tokens else 7, -0.1)
            for seq in plan.seqs if seq.sample is not None]))
    return steps


def test_a_lone_decode_is_continuable_to_its_last_token_with_its_next_block_ahead():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", prompt_len=6))  # 10 outputs: decodes at positions 6 .. 14
    plans = []
    steps = _run(scheduler, 20, plans=plans)
    assert steps[0] == (False, [(steps[0][1][0][0], 0, 6)])  # the prefill
    decodes = {seqs[0][1]: continuable for continuable, seqs in steps[1:]}
    assert sorted(decodes) == list(range(6, 15))
    # after position 14 the tenth output ends the request; before, the next position is always in
    # a block the plan gives (positions 8 and 12 start blocks taken one plan or more ahead)
    assert [position for position, continuable in decodes.items() if not continuable] == [14]
    for plan in plans[1:-1]:
        (seq,) = plan.seqs
        assert len(seq.block_table) * BLOCK_SIZE > seq.start_position + 1
        # a run to the end of its blocks, short of the answer's last token
        assert plan.num_steps == min(len(seq.block_table) * BLOCK_SIZE - seq.start_position, 14 - seq.start_position)
    assert plans[-1].num_steps == 1
    assert len(set(plans[-1].seqs[0].block_table)) == 4  # positions 0 .. 14: no block beyond


def test_a_continuable_run_leaves_the_step_after_it_in_its_blocks():
    # blocks of MAX_RUN_STEPS positions or more (16, the default, and 32): a run of MAX_RUN_STEPS
    # can fill a block to its end, and the step the worker computes after it then needs the next
    # block in the run's own plan
    for block_size in (16, 32):
        scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, max_model_len=256, block_size=block_size,
                                              max_num_seqs=4, max_num_batched_tokens=256))
        scheduler.add_request(_request("a", prompt_len=6, max_tokens=60))
        plans = []
        _run(scheduler, 70, plans=plans)
        runs = [plan for plan in plans if plan.continuable]
        assert len(runs) == 58 and max(plan.num_steps for plan in runs) == MAX_RUN_STEPS
        for plan in runs:
            (seq,) = plan.seqs
            assert seq.start_position + plan.num_steps < len(seq.block_table) * block_size, (block_size, plan)
        scheduler.check_invariants()


def test_no_block_ahead_while_a_request_waits_or_the_pool_is_short():
    # b cannot run beside a (max_num_seqs=1): a's plans take no block ahead, and stop being runs
    scheduler = _scheduler(max_num_seqs=1)
    scheduler.add_request(_request("a", prompt_len=3, max_tokens=12))
    plans = []
    _run(scheduler, 3, add_at={1: _request("b", prompt_len=3)}, plans=plans)
    assert [len(plan.seqs[0].block_table) for plan in plans] == [1, 1, 2]  # positions 0-2, 3, then 4 in a new block
    assert [plan.num_steps for plan in plans] == [1, 1, 1]
    # five blocks: a holds one, b another; a block ahead would leave no free block per running group
    scheduler = _scheduler(num_gpu_blocks=4)
    for name in ("a", "b"):
        scheduler.add_request(_request(name, prompt_len=3, max_tokens=12))
    plans = []
    _run(scheduler, 2, plans=plans)
    assert all(len(seq.block_table) == 1 for seq in plans[1].seqs)  # both at position 3: no block ahead
    assert plans[1].num_steps == 1 and not plans[1].continuable  # the next position starts a block


def test_not_continuable_while_a_request_waits():
    scheduler = _scheduler(max_num_seqs=1)
    scheduler.add_request(_request("a", prompt_len=5))
    steps = _run(scheduler, 4, add_at={2: _request("b", prompt_len=5)})
    assert [continuable for continuable, _ in steps] == [False, True, False, False]


def test_not_continuable_with_penalties_min_tokens_beams_or_several_completions():
    for sampling in (dict(presence_penalty=0.5), dict(min_tokens=5, ignore_eos=False), dict(n=2),
                     dict(beam_width=2)):
        scheduler = _scheduler()
        scheduler.add_request(_request("a", prompt_len=5, **sampling))
        assert not any(continuable for continuable, _ in _run(scheduler, 6)), sampling


def test_a_batch_is_a_run_only_when_every_sequence_is():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", prompt_len=5))
    scheduler.add_request(_request("b", prompt_len=7, presence_penalty=0.5))  # its spec changes with its tokens
    plans = []
    _run(scheduler, 6, plans=plans)
    assert all(plan.num_steps == 1 and not plan.continuable for plan in plans if len(plan.seqs) == 2)
    assert sum(len(plan.seqs) == 2 for plan in plans) >= 4


def test_runs_of_more_sequences_than_a_step_computed_ahead_streamed_or_not_and_not_above_the_limit():
    from pagedserve.scheduler.core.continuable import MAX_CONTINUABLE_SEQS, MAX_RUN_SEQS

    cases = ((MAX_CONTINUABLE_SEQS + 1, True, True), (MAX_RUN_SEQS, True, True), (MAX_RUN_SEQS + 1, True, False),
             (MAX_CONTINUABLE_SEQS, False, True), (MAX_CONTINUABLE_SEQS + 1, False, True),
             (MAX_RUN_SEQS, False, True), (MAX_RUN_SEQS + 1, False, False))
    for num_requests, hold, is_run in cases:  # hold: every request takes its whole answer at the end
        scheduler = _scheduler(max_num_seqs=MAX_RUN_SEQS + 1, num_gpu_blocks=4 * (MAX_RUN_SEQS + 1) + 8)
        for index in range(num_requests):
            scheduler.add_request(dataclasses.replace(_request(f"r{index}", prompt_len=5), hold_output=hold))
        plans = []
        steps = _run(scheduler, 4, plans=plans)
        decodes = [plan for plan in plans if len(plan.seqs) == num_requests and all(
            len(seq.token_ids) == 1 for seq in plan.seqs)]
        assert len(decodes) == 3, num_requests
        assert all(continuable == (is_run and num_requests <= MAX_CONTINUABLE_SEQS) for continuable, _ in steps[1:])
        assert all((plan.num_steps > 1) == is_run for plan in decodes), (num_requests, hold)
        # at positions 5, 6, 7 each sequence of a run holds a block ahead: runs to position 11
        assert [plan.num_steps for plan in decodes] == ([7, 6, 5] if is_run else [1, 1, 1])
        assert all(len(seq.block_table) == (3 if is_run else 2) for plan in decodes for seq in plan.seqs)
        assert all(plan.end_token_ids == [] for plan in decodes)  # EOS ignored
        assert all(plan.streams_steps == (is_run and not hold) for plan in decodes)


def test_not_continuable_while_speculating():
    """With n-gram speculation a step without proposals may be followed by one with them: here no
    token repeats, so no step has proposals, and none is continuable."""
    scheduler = _scheduler(speculative_method="ngram")
    scheduler.add_request(_request("a", prompt_len=6))
    steps = _run(scheduler, 8, distinct_tokens=True)
    assert all(num_tokens == 1 for _, seqs in steps[1:] for _, _, num_tokens in seqs)  # no proposals
    assert len(steps) == 8 and not any(continuable for continuable, _ in steps)
