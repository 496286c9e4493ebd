"""Beam search through the Scheduler: candidate counts, forks that share blocks, dropped beams
freed at once, one final output with every beam best first."""

from __future__ import annotations

import pytest

from pagedserve.contracts.request_types import FinishReason, Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.contracts.step_plan import SeqSample, StepResult


def _scheduler(**overrides) -> Scheduler:
    arguments = {"num_gpu_blocks": 64, "max_model_len": 256, "block_size": 4, "max_num_seqs": 8,
                 "max_num_batched_tokens": 64} | overrides
    return Scheduler(SchedulerConfig(**arguments))


def _answer(step, candidates_of: dict[int, list[tuple[int, float]]]) -> StepResult:
    samples = []
    for seq in step.plan.seqs:
        if seq.sample is not None:
            tokens, logprobs = zip(*candidates_of[seq.seq_id])
            samples.append(SeqSample(seq.seq_id, tokens[0], logprobs[0], beam_token_ids=list(tokens),
                                     beam_logprobs=list(logprobs)))
    return StepResult(step.plan.step_id, samples)


def test_beam_search_through_the_scheduler() -> None:
    scheduler = _scheduler()
    scheduler.add_request(Request("b", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=10, beam_width=2),
                                  eos_token_ids=[0]))
    # Step 1: the prompt as one sequence; 2 * k candidates.
    step = scheduler.schedule()
    (root,) = step.plan.seqs
    assert (len(root.token_ids), root.sample.num_beam_candidates) == (6, 4)
    assert scheduler.process_result(step, _answer(step, {root.seq_id: [(5, -0.5), (0, -1.0), (6, -1.5), (7, -2.0)]})) == []
    group = scheduler.group_of("b")
    assert [seq.output_token_ids for seq in group.seqs] == [[5], [6]]
    assert group.seqs[0].block_table == group.seqs[1].block_table  # forked: every block shared
    assert scheduler.num_blocks_of_request("b") == 2

    # Step 2: both beams compute their token; the shared partial block is copied once.
    step = scheduler.schedule()
    assert len(step.plan.seqs) == 2 and len(step.plan.blocks_to_copy) == 1
    first, second = (seq.seq_id for seq in group.seqs)
    outputs = scheduler.process_result(step, _answer(step, {
        first: [(0, -0.1), (8, -0.2), (9, -3.0), (10, -3.1)],
        second: [(11, -0.05), (0, -0.3), (12, -4.0), (13, -4.5)]}))
    assert outputs == []
    assert [seq.output_token_ids for seq in group.seqs] == [[5, 8], [6, 11]]
    scheduler.check_invariants()

    # Step 3: both continuations come from beam 1: beam 0 is dropped and its blocks freed.
    step = scheduler.schedule()
    first, second = (seq.seq_id for seq in group.seqs)
    used_before = scheduler.stats().gpu.num_used
    scheduler.process_result(step, _answer(step, {
        first: [(14, -5.0), (15, -5.1), (0, -5.2), (16, -5.3)],
        second: [(17, -0.1), (18, -0.2), (19, -3.1), (20, -3.2)]}))
    assert [seq.output_token_ids for seq in group.seqs] == [[6, 11, 17], [6, 11, 18]]
    assert scheduler.stats().gpu.num_used < used_before
    scheduler.check_invariants()

    # Step 4: EOS on the best beam; [6, 11, 17, 0] at -2.65 / 4 beats [0] (-1.0), and the best
    # running beam cannot reach -0.6625 any more.
    step = scheduler.schedule()
    first, second = (seq.seq_id for seq in group.seqs)
    outputs = scheduler.process_result(step, _answer(step, {
        first: [(0, -1.0), (21, -1.2), (22, -5.0), (23, -6.0)],
        second: [(24, -1.5), (25, -1.6), (0, -1.7), (26, -9.0)]}))
    (output,) = outputs
    assert output.is_finished and not scheduler.has_unfinished_requests()
    assert [(d.index, d.token_ids, d.finish_reason) for d in output.deltas] == [
        (0, [5, 0], FinishReason.STOP), (1, [6, 11, 17, 0], FinishReason.STOP)]
    assert [d.cumulative_logprob for d in output.deltas] == [pytest.approx(-0.3), pytest.approx(-0.6625)]
    assert scheduler.stats().gpu.num_used == 0
    scheduler.check_invariants()


def test_beam_candidates_grow_with_the_number_of_stop_ids_and_min_tokens_suppresses_them() -> None:
    scheduler = _scheduler()
    scheduler.add_request(Request("b", [1, 2], SamplingParams(max_tokens=4, beam_width=3, min_tokens=1,
                                                              stop_token_ids=[9]), eos_token_ids=[0, 1]))
    step = scheduler.schedule()
    spec = step.plan.seqs[0].sample
    assert spec.num_beam_candidates == (1 + 3) * 3
    assert spec.suppress_token_ids == [0, 1, 9]


def test_finish_completion_does_not_apply_to_beams() -> None:
    scheduler = _scheduler()
    scheduler.add_request(Request("b", [1, 2], SamplingParams(max_tokens=4, beam_width=2)))
    assert not scheduler.finish_completion("b", 0)
    assert scheduler.abort_request("b")
