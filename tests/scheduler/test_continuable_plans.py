"""StepPlan.continuable: set exactly when the worker may compute the next step ahead
(worker/continuation.py): every sequence decodes one sampled token in a block it owns alone with
room for the next position, under a spec its tokens do not change, with more tokens to go, and
nothing waits or is swapped out."""

from __future__ import annotations

from pagedserve.contracts.request_types import Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.contracts.step_plan import SeqSample, StepResult
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.scheduler import Scheduler

BLOCK_SIZE = 4


def _scheduler(max_num_seqs: int = 4, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=64, max_model_len=256, block_size=BLOCK_SIZE,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=256, **config))


def _request(request_id: str, prompt_len: int = 6, **sampling) -> Request:
    sampling = {"max_tokens": 10, "ignore_eos": True, **sampling}
    return Request(request_id, list(range(4, 4 + prompt_len)), SamplingParams(**sampling), eos_token_ids=[2])


def _run(scheduler: Scheduler, num_steps: int, add_at: dict[int, Request] | None = None,
         distinct_tokens: bool = False) -> list[tuple[bool, list]]:
    """(continuable, [(seq_id, position of its first new token, number of new tokens)]) per step."""
    steps = []
    for index in range(num_steps):
        if add_at and index in add_at:
            scheduler.add_request(add_at[index])
        step = scheduler.schedule()
        if step is None:
            break
        plan = step.plan
        steps.append((plan.continuable, [(seq.seq_id, seq.start_position, len(seq.token_ids)) for seq in plan.seqs]))
        scheduler.process_result(step, StepResult(step_id=plan.step_id, epoch=plan.epoch, samples=[
            SeqSample(seq.seq_id, 200 + index if distinct_tokens else 7, -0.1)
            for seq in plan.seqs if seq.sample is not None]))
    return steps


def test_a_lone_decode_is_continuable_but_before_a_new_block_and_its_last_token():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", prompt_len=6))  # 10 outputs: decodes at positions 6 .. 14
    steps = _run(scheduler, 20)
    assert steps[0] == (False, [(steps[0][1][0][0], 0, 6)])  # the prefill
    decodes = {seqs[0][1]: continuable for continuable, seqs in steps[1:]}
    assert sorted(decodes) == list(range(6, 15))
    # the next position 8 or 12 starts a block; after position 14 the tenth output ends the request
    assert [position for position, continuable in decodes.items() if not continuable] == [7, 11, 14]


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


def test_a_batch_is_continuable_only_when_every_sequence_is():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", prompt_len=5))
    scheduler.add_request(_request("b", prompt_len=7))
    steps = _run(scheduler, 6)[1:]  # after the prefills, a decodes at 5, 6, 7, ... and b at 7, 8, 9, ...
    flags = {seqs[1][1]: continuable for continuable, seqs in steps if len(seqs) == 2}
    # b at 7 and a at 7 (the step where b is at 9) are followed by a new block
    assert [flags[position] for position in (7, 8, 9, 10)] == [False, True, False, True]


def test_not_continuable_above_the_batch_limit():
    from pagedserve.scheduler.core.continuable import MAX_CONTINUABLE_SEQS

    scheduler = _scheduler(max_num_seqs=8)
    for index in range(MAX_CONTINUABLE_SEQS + 1):
        scheduler.add_request(_request(f"r{index}", prompt_len=5))
    steps = _run(scheduler, 3)
    assert len(steps[1][1]) == MAX_CONTINUABLE_SEQS + 1 and not any(continuable for continuable, _ in steps)


def test_not_continuable_while_speculating():
    """With n-gram speculation a step without proposals may be followed by one with them: here no
    token repeats, so no step has proposals, and none is continuable."""
    scheduler = _scheduler(speculative_method="ngram")
    scheduler.add_request(_request("a", prompt_len=6))
    steps = _run(scheduler, 8, distinct_tokens=True)
    assert all(num_tokens == 1 for _, seqs in steps[1:] for _, _, num_tokens in seqs)  # no proposals
    assert len(steps) == 8 and not any(continuable for continuable, _ in steps)
