"""Step plans and results survive the protobuf round trip unchanged."""

from __future__ import annotations

from pagedserve.internal import step_pb2
from pagedserve.contracts.plan_codec import (encode_plan, encode_result, plan_from_proto, plan_to_proto,
                                   result_from_proto, result_to_proto)
from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, SeqFailure, SeqSample, StepPlan, StepResult


def _plan() -> StepPlan:
    return StepPlan(
        step_id=7,
        epoch=2,
        seqs=[
            ScheduledSeq(seq_id=1, token_ids=[5, 6, 7], start_position=0, block_table=[3]),
            ScheduledSeq(seq_id=2, token_ids=[9], start_position=40, block_table=[1, 70000, 4],
                         sample=SampleSpec(temperature=0.5, top_p=0.875, top_k=4, min_p=0.125,
                                           seed=2**40, output_index=3, repetition_penalty=1.25,
                                           presence_penalty=0.5, frequency_penalty=-0.5,
                                           num_logprobs=2, num_beam_candidates=0,
                                           suppress_token_ids=[0, 2], prompt_token_ids=[1, 2],
                                           output_token_ids=[9])),
            ScheduledSeq(seq_id=3, token_ids=[1], start_position=0, block_table=[8],
                         sample=SampleSpec()),
        ],
        blocks_to_swap_out=[(1, 2)],
        blocks_to_swap_in=[(3, 4), (5, 6)],
        blocks_to_copy=[(7, 8)],
    )


def test_plan_round_trip() -> None:
    plan = _plan()
    assert plan_from_proto(plan_to_proto(plan)) == plan


def test_unseeded_sample_stays_unseeded() -> None:
    decoded = plan_from_proto(plan_to_proto(_plan()))
    assert decoded.seqs[2].sample.seed is None
    assert decoded.seqs[0].sample is None


def test_encoded_plan_parses_as_scheduler_message() -> None:
    message = step_pb2.SchedulerMessage.FromString(encode_plan(_plan()))
    assert message.WhichOneof("kind") == "step_plan"
    assert plan_from_proto(message.step_plan) == _plan()


def test_result_round_trip() -> None:
    result = StepResult(step_id=3, epoch=1, forward_seconds=0.25, samples=[
        SeqSample(seq_id=2, token_id=11, logprob=-0.5, top_token_ids=[11, 4],
                  top_logprobs=[-0.5, -1.5]),
        SeqSample(seq_id=9, token_id=1, logprob=-2.0, beam_token_ids=[1, 2],
                  beam_logprobs=[-2.0, -3.0]),
    ], failures=[SeqFailure(seq_id=5, message="sampling failed: ValueError: bad")])
    assert result_from_proto(result_to_proto(result)) == result
    message = step_pb2.WorkerMessage.FromString(encode_result(result))
    assert result_from_proto(message.step_result) == result


def test_equal_specs_are_sent_once_and_penalty_specs_each() -> None:
    greedy = [SampleSpec(), SampleSpec(), SampleSpec(output_index=1)]
    penalised = [SampleSpec(repetition_penalty=1.5, prompt_token_ids=[1], output_token_ids=[2]),
                 SampleSpec(repetition_penalty=1.5, prompt_token_ids=[1], output_token_ids=[2])]
    specs = [*greedy, *penalised, None]
    plan = StepPlan(step_id=1, seqs=[ScheduledSeq(seq_id=i, token_ids=[i + 1], start_position=i,
                                                  block_table=[i], sample=spec)
                                     for i, spec in enumerate(specs)])
    message = plan_to_proto(plan)
    assert len(message.samples) == 4  # greedy once, output index 1, both penalty specs
    assert list(message.sample_index) == [0, 0, 1, 2, 3, -1]
    assert plan_from_proto(message) == plan


def test_empty_plan_and_result_round_trip() -> None:
    plan = StepPlan(step_id=4, epoch=1, blocks_to_copy=[(2, 3)])
    assert plan_from_proto(plan_to_proto(plan)) == plan
    result = StepResult(step_id=4, epoch=1)
    assert result_from_proto(result_to_proto(result)) == result


def test_columns_keep_each_sequence_its_own_tokens_and_blocks() -> None:
    seqs = [ScheduledSeq(seq_id=10 + i, token_ids=list(range(i * 5, i * 5 + i + 1)), start_position=3 * i,
                         block_table=list(range(100 * i, 100 * i + i % 3 + 1)),
                         sample=SampleSpec(temperature=0.5 * (i % 2)) if i % 4 else None)
            for i in range(40)]
    plan = StepPlan(step_id=2, seqs=seqs)
    assert plan_from_proto(step_pb2.SchedulerMessage.FromString(encode_plan(plan)).step_plan) == plan


def test_draft_counts_round_trip_and_cost_nothing_without_drafts() -> None:
    spec = SampleSpec(temperature=0.5)
    plan = StepPlan(step_id=3, seqs=[ScheduledSeq(1, [5, 6, 7], 9, [0], spec, 2),
                                     ScheduledSeq(2, [8], 4, [1], spec)])
    msg = plan_to_proto(plan)
    assert list(msg.num_draft_tokens) == [2, 0]
    assert [seq.num_draft_tokens for seq in plan_from_proto(msg).seqs] == [2, 0]
    plain = StepPlan(step_id=4, seqs=[ScheduledSeq(2, [8], 4, [1], spec)])
    assert not plan_to_proto(plain).num_draft_tokens


def test_worker_draft_context_round_trips() -> None:
    spec = SampleSpec()
    plan = StepPlan(step_id=5, drafts_from_worker=True, seqs=[
        ScheduledSeq(1, [5, 0, 0, 0], 9, [0, 1], spec, 3, draft_context_ids=[3, 4], draft_start_position=7),
        ScheduledSeq(2, [8], 4, [2], spec),
        ScheduledSeq(3, [9, 0], 20, [3, 4], spec, 1, draft_start_position=20)])
    decoded = plan_from_proto(step_pb2.SchedulerMessage.FromString(encode_plan(plan)).step_plan)
    assert decoded == plan
    assert decoded.seqs[0].draft_context_ids == [3, 4] and decoded.seqs[2].draft_start_position == 20
    assert not plan_to_proto(StepPlan(step_id=6, seqs=[ScheduledSeq(2, [8], 4, [1], spec)])).draft_context_ids


def test_kv_tier_operations_round_trip_and_are_absent_when_empty() -> None:
    from pagedserve.contracts.tier_ops import TierOps, TierSave

    ops = TierOps(saves=[TierSave(3, 7, b"k" * 16, True), TierSave(4, -1, b"j" * 16, True), TierSave(5, 2, b"i" * 16)],
                  fetches=[(b"f" * 16, 1)], loads=[(7, 9), (2, 10)], deletes=[b"d" * 16])
    plan = StepPlan(step_id=4, epoch=2, tier_ops=ops)
    assert plan_from_proto(plan_to_proto(plan)) == plan
    assert not plan_to_proto(StepPlan(step_id=5, tier_ops=TierOps())).HasField("tier_ops")
    assert plan_from_proto(plan_to_proto(StepPlan(step_id=5))).tier_ops is None
    result = StepResult(step_id=4, epoch=2, failed_fetch_keys=[b"f" * 16])
    assert result_from_proto(result_to_proto(result)) == result


def test_lora_slots_and_loads_round_trip_and_cost_nothing_without_adapters() -> None:
    from pagedserve.contracts.step_plan import LoraLoad

    spec = SampleSpec()
    plan = StepPlan(step_id=7, lora_loads=[LoraLoad(1, "sql", "/adapters/sql", "ab" * 32)], seqs=[
        ScheduledSeq(1, [5], 3, [0], spec, lora_slot=1), ScheduledSeq(2, [8], 4, [1], spec),
        ScheduledSeq(3, [9], 5, [2], spec, lora_slot=0)])
    msg = plan_to_proto(plan)
    assert list(msg.lora_slots) == [2, 0, 1]
    assert plan_from_proto(step_pb2.SchedulerMessage.FromString(encode_plan(plan)).step_plan) == plan
    plain = plan_to_proto(StepPlan(step_id=8, seqs=[ScheduledSeq(2, [8], 4, [1], spec)]))
    assert not plain.lora_slots and not plain.lora_loads


def test_a_decode_run_round_trips_and_one_step_costs_no_field() -> None:
    plan = _plan()
    plan.continuable, plan.num_steps, plan.end_token_ids = True, 6, [0, 2, 49151]
    assert plan_from_proto(plan_to_proto(plan)) == plan
    result = StepResult(step_id=3, epoch=1, num_steps=2, samples=[
        SeqSample(seq_id=2, token_id=11, logprob=-0.5), SeqSample(seq_id=2, token_id=12, logprob=-0.25)])
    assert result_from_proto(result_to_proto(result)) == result
    assert plan_to_proto(_plan()).num_steps == 0
    assert result_to_proto(StepResult(step_id=3)).num_steps == 0
    assert plan_from_proto(plan_to_proto(_plan())).num_steps == result_from_proto(result_to_proto(StepResult(3))).num_steps == 1
