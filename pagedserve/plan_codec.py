"""Converts step plans, results and worker messages between dataclasses and protobuf bytes.

Protobuf is the one wire format between the scheduler and the workers; the dataclasses in
step_plan.py are what both sides compute with.
"""

from __future__ import annotations

from pagedserve.internal import step_pb2
from pagedserve.step_plan import SampleSpec, ScheduledSeq, SeqSample, StepPlan, StepResult


def _pairs_to_proto(pairs: list[tuple[int, int]], out: step_pb2.BlockPair) -> None:
    if pairs:
        out.src.extend(src for src, _ in pairs)
        out.dst.extend(dst for _, dst in pairs)


def _pairs_from_proto(msg: step_pb2.BlockPair) -> list[tuple[int, int]]:
    return list(zip(msg.src, msg.dst))


def _sample_to_proto(spec: SampleSpec, out: step_pb2.SampleSpec) -> None:
    out.temperature = spec.temperature
    out.top_p = spec.top_p
    out.top_k = spec.top_k
    out.min_p = spec.min_p
    if spec.seed is not None:
        out.has_seed = True
        out.seed = spec.seed
    out.output_index = spec.output_index
    out.repetition_penalty = spec.repetition_penalty
    out.presence_penalty = spec.presence_penalty
    out.frequency_penalty = spec.frequency_penalty
    out.num_logprobs = spec.num_logprobs
    out.num_beam_candidates = spec.num_beam_candidates
    if spec.suppress_token_ids:
        out.suppress_token_ids.extend(spec.suppress_token_ids)
    if spec.prompt_token_ids:
        out.prompt_token_ids.extend(spec.prompt_token_ids)
    if spec.output_token_ids:
        out.output_token_ids.extend(spec.output_token_ids)


def _sample_from_proto(msg: step_pb2.SampleSpec) -> SampleSpec:
    return SampleSpec(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.has_seed else None,
        output_index=msg.output_index,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        num_logprobs=msg.num_logprobs,
        num_beam_candidates=msg.num_beam_candidates,
        suppress_token_ids=list(msg.suppress_token_ids),
        prompt_token_ids=list(msg.prompt_token_ids),
        output_token_ids=list(msg.output_token_ids),
    )


def plan_to_proto(plan: StepPlan) -> step_pb2.StepPlan:
    msg = step_pb2.StepPlan(epoch=plan.epoch, step_id=plan.step_id)
    for seq in plan.seqs:
        out = msg.seqs.add(seq_id=seq.seq_id, start_position=seq.start_position)
        out.token_ids.extend(seq.token_ids)
        out.block_table.extend(seq.block_table)
        if seq.sample is not None:
            out.has_sample = True
            _sample_to_proto(seq.sample, out.sample)
    _pairs_to_proto(plan.blocks_to_swap_out, msg.blocks_to_swap_out)
    _pairs_to_proto(plan.blocks_to_swap_in, msg.blocks_to_swap_in)
    _pairs_to_proto(plan.blocks_to_copy, msg.blocks_to_copy)
    return msg


def plan_from_proto(msg: step_pb2.StepPlan) -> StepPlan:
    seqs = [
        ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=list(seq.token_ids),
            start_position=seq.start_position,
            block_table=list(seq.block_table),
            sample=_sample_from_proto(seq.sample) if seq.has_sample else None,
        )
        for seq in msg.seqs
    ]
    return StepPlan(
        step_id=msg.step_id,
        seqs=seqs,
        blocks_to_swap_out=_pairs_from_proto(msg.blocks_to_swap_out),
        blocks_to_swap_in=_pairs_from_proto(msg.blocks_to_swap_in),
        blocks_to_copy=_pairs_from_proto(msg.blocks_to_copy),
        epoch=msg.epoch,
    )


def result_to_proto(result: StepResult) -> step_pb2.StepResult:
    msg = step_pb2.StepResult(epoch=result.epoch, step_id=result.step_id,
                              forward_seconds=result.forward_seconds)
    for sample in result.samples:
        out = msg.samples.add(seq_id=sample.seq_id, token_id=sample.token_id, logprob=sample.logprob)
        if sample.top_token_ids:
            out.top_token_ids.extend(sample.top_token_ids)
            out.top_logprobs.extend(sample.top_logprobs)
        if sample.beam_token_ids:
            out.beam_token_ids.extend(sample.beam_token_ids)
            out.beam_logprobs.extend(sample.beam_logprobs)
    return msg


def result_from_proto(msg: step_pb2.StepResult) -> StepResult:
    samples = [
        SeqSample(
            seq_id=s.seq_id,
            token_id=s.token_id,
            logprob=s.logprob,
            top_token_ids=list(s.top_token_ids),
            top_logprobs=list(s.top_logprobs),
            beam_token_ids=list(s.beam_token_ids),
            beam_logprobs=list(s.beam_logprobs),
        )
        for s in msg.samples
    ]
    return StepResult(step_id=msg.step_id, samples=samples, forward_seconds=msg.forward_seconds,
                      epoch=msg.epoch)


def encode_plan(plan: StepPlan) -> bytes:
    return step_pb2.SchedulerMessage(step_plan=plan_to_proto(plan)).SerializeToString()


def encode_result(result: StepResult) -> bytes:
    return step_pb2.WorkerMessage(step_result=result_to_proto(result)).SerializeToString()
