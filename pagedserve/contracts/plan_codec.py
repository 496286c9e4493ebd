"""Converts step plans, results and worker messages between dataclasses and protobuf bytes.

Protobuf is the one wire format between the scheduler and the workers; the dataclasses in
step_plan.py are what both sides compute with. Sequences and samples travel as columns of
packed arrays (see proto/pagedserve/internal/step.proto), equal sampling specs once per step.
"""

from __future__ import annotations

from itertools import chain

from pagedserve.internal import step_pb2
from pagedserve.contracts.tier_ops import TierOps, TierSave
from pagedserve.contracts.step_plan import LoraLoad, SampleSpec, ScheduledSeq, SeqFailure, SeqSample, StepPlan, StepResult


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
    if spec.logit_bias:
        out.logit_bias_token_ids.extend(spec.logit_bias.keys())
        out.logit_bias_values.extend(spec.logit_bias.values())


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
        logit_bias=dict(zip(msg.logit_bias_token_ids, msg.logit_bias_values)),
    )


def _spec_key(spec: SampleSpec) -> tuple | None:
    """Value of a spec for sharing one wire entry among equal specs; None for penalty specs
    (they carry token histories and are sent as they are)."""
    if spec.prompt_token_ids or spec.output_token_ids:
        return None
    return (spec.temperature, spec.top_p, spec.top_k, spec.min_p, spec.seed, spec.output_index,
            spec.repetition_penalty, spec.presence_penalty, spec.frequency_penalty, spec.num_logprobs,
            spec.num_beam_candidates, tuple(spec.suppress_token_ids), tuple(spec.logit_bias.items()))


def plan_to_proto(plan: StepPlan) -> step_pb2.StepPlan:
    msg = step_pb2.StepPlan(epoch=plan.epoch, step_id=plan.step_id)
    seqs = plan.seqs
    msg.seq_ids.extend([seq.seq_id for seq in seqs])
    msg.start_positions.extend([seq.start_position for seq in seqs])
    msg.num_tokens.extend([len(seq.token_ids) for seq in seqs])
    msg.token_ids.extend(list(chain.from_iterable(seq.token_ids for seq in seqs)))
    msg.num_blocks.extend([len(seq.block_table) for seq in seqs])
    msg.block_ids.extend(list(chain.from_iterable(seq.block_table for seq in seqs)))
    by_object: dict[int, int] = {}  # id(spec) -> index in msg.samples
    by_value: dict[tuple, int] = {}
    sample_index = []
    for seq in seqs:
        spec = seq.sample
        if spec is None:
            sample_index.append(-1)
            continue
        index = by_object.get(id(spec))
        if index is None:
            key = _spec_key(spec)
            index = by_value.get(key) if key is not None else None
            if index is None:
                index = len(msg.samples)
                _sample_to_proto(spec, msg.samples.add())
                if key is not None:
                    by_value[key] = index
            by_object[id(spec)] = index
        sample_index.append(index)
    msg.sample_index.extend(sample_index)
    if any(seq.num_draft_tokens for seq in seqs):
        msg.num_draft_tokens.extend([seq.num_draft_tokens for seq in seqs])
    if any(seq.num_mask_rows for seq in seqs):
        msg.num_mask_rows.extend([seq.num_mask_rows for seq in seqs])
        if plan.masks_follow:
            msg.masks_follow = True
        else:
            msg.token_bitmasks = b"".join(seq.token_bitmask for seq in seqs)
    if plan.continuable:
        msg.continuable = True
    if plan.num_steps > 1:
        msg.num_steps = plan.num_steps
    if plan.streams_steps:
        msg.streams_steps = True
    msg.end_token_ids.extend(plan.end_token_ids)
    if plan.drafts_from_worker:
        msg.drafts_from_worker = True
        msg.draft_start_positions.extend([seq.draft_start_position for seq in seqs])
        msg.num_draft_context_tokens.extend([len(seq.draft_context_ids) for seq in seqs])
        msg.draft_context_ids.extend(list(chain.from_iterable(seq.draft_context_ids for seq in seqs)))
    if any(seq.lora_slot >= 0 for seq in seqs):
        msg.lora_slots.extend([seq.lora_slot + 1 for seq in seqs])
    for load in plan.lora_loads:
        msg.lora_loads.add(slot=load.slot, name=load.name, path=load.path, digest=load.digest)
    _pairs_to_proto(plan.blocks_to_swap_out, msg.blocks_to_swap_out)
    _pairs_to_proto(plan.blocks_to_swap_in, msg.blocks_to_swap_in)
    _pairs_to_proto(plan.blocks_to_copy, msg.blocks_to_copy)
    if plan.tier_ops is not None and not plan.tier_ops.is_empty:
        _tier_ops_to_proto(plan.tier_ops, msg.tier_ops)
    return msg


def _tier_ops_to_proto(ops: TierOps, out: step_pb2.TierOps) -> None:
    out.save_blocks.extend([save.block_id for save in ops.saves])
    out.save_slots.extend([save.host_slot for save in ops.saves])
    out.save_to_disk.extend([save.to_disk for save in ops.saves])
    out.save_keys.extend([save.key for save in ops.saves])
    out.fetch_keys.extend([key for key, _ in ops.fetches])
    out.fetch_slots.extend([slot for _, slot in ops.fetches])
    out.load_slots.extend([slot for slot, _ in ops.loads])
    out.load_blocks.extend([block for _, block in ops.loads])
    out.delete_keys.extend(ops.deletes)


def _tier_ops_from_proto(msg: step_pb2.TierOps) -> TierOps:
    return TierOps(
        saves=[TierSave(block, slot, key, to_disk) for block, slot, to_disk, key
               in zip(msg.save_blocks, msg.save_slots, msg.save_to_disk, msg.save_keys)],
        fetches=list(zip(msg.fetch_keys, msg.fetch_slots)),
        loads=list(zip(msg.load_slots, msg.load_blocks)),
        deletes=list(msg.delete_keys))


def plan_from_proto(msg: step_pb2.StepPlan) -> StepPlan:
    """Sequences with equal specs share one SampleSpec object (the worker only reads them)."""
    specs = [_sample_from_proto(sample) for sample in msg.samples]
    token_ids, block_ids = list(msg.token_ids), list(msg.block_ids)
    seqs = []
    token_start = block_start = 0
    for seq_id, start_position, num_tokens, num_blocks, sample_index in zip(
            msg.seq_ids, msg.start_positions, msg.num_tokens, msg.num_blocks, msg.sample_index):
        token_end, block_end = token_start + num_tokens, block_start + num_blocks
        seqs.append(ScheduledSeq(seq_id, token_ids[token_start:token_end], start_position,
                                 block_ids[block_start:block_end],
                                 specs[sample_index] if sample_index >= 0 else None))
        token_start, block_start = token_end, block_end
    for seq, num_drafts in zip(seqs, msg.num_draft_tokens):
        seq.num_draft_tokens = num_drafts
    for seq, num_rows in zip(seqs, msg.num_mask_rows):
        seq.num_mask_rows = num_rows
    if msg.num_mask_rows and not msg.masks_follow:
        attach_masks(seqs, msg.token_bitmasks)
    if msg.drafts_from_worker:
        context_ids = list(msg.draft_context_ids)
        context_start = 0
        for seq, start_position, num_context in zip(seqs, msg.draft_start_positions, msg.num_draft_context_tokens):
            seq.draft_start_position = start_position
            seq.draft_context_ids = context_ids[context_start:context_start + num_context]
            context_start += num_context
    for seq, slot in zip(seqs, msg.lora_slots):
        seq.lora_slot = slot - 1
    return StepPlan(
        masks_follow=msg.masks_follow,
        continuable=msg.continuable,
        num_steps=max(1, msg.num_steps),
        end_token_ids=list(msg.end_token_ids),
        streams_steps=msg.streams_steps,
        step_id=msg.step_id,
        seqs=seqs,
        blocks_to_swap_out=_pairs_from_proto(msg.blocks_to_swap_out),
        blocks_to_swap_in=_pairs_from_proto(msg.blocks_to_swap_in),
        blocks_to_copy=_pairs_from_proto(msg.blocks_to_copy),
        epoch=msg.epoch,
        drafts_from_worker=msg.drafts_from_worker,
        tier_ops=_tier_ops_from_proto(msg.tier_ops) if msg.HasField("tier_ops") else None,
        lora_loads=[LoraLoad(load.slot, load.name, load.path, load.digest) for load in msg.lora_loads],
    )


def result_to_proto(result: StepResult) -> step_pb2.StepResult:
    msg = step_pb2.StepResult(epoch=result.epoch, step_id=result.step_id,
                              forward_seconds=result.forward_seconds)
    samples = result.samples
    msg.seq_ids.extend([sample.seq_id for sample in samples])
    msg.token_ids.extend([sample.token_id for sample in samples])
    msg.logprobs.extend([sample.logprob for sample in samples])
    if any(sample.top_token_ids for sample in samples):
        msg.num_top.extend([len(sample.top_token_ids) for sample in samples])
        msg.top_token_ids.extend(list(chain.from_iterable(sample.top_token_ids for sample in samples)))
        msg.top_logprobs.extend(list(chain.from_iterable(sample.top_logprobs for sample in samples)))
    if any(sample.beam_token_ids for sample in samples):
        msg.num_beam.extend([len(sample.beam_token_ids) for sample in samples])
        msg.beam_token_ids.extend(list(chain.from_iterable(sample.beam_token_ids for sample in samples)))
        msg.beam_logprobs.extend(list(chain.from_iterable(sample.beam_logprobs for sample in samples)))
    msg.failed_seq_ids.extend([failure.seq_id for failure in result.failures])
    msg.failure_messages.extend([failure.message for failure in result.failures])
    msg.failed_fetch_keys.extend(result.failed_fetch_keys)
    if result.num_steps > 1:
        msg.num_steps = result.num_steps
    if result.run_step:
        msg.run_step = result.run_step
    return msg


def _split(counts, values) -> list[list]:
    """values cut into consecutive lists of counts[i] items; empty lists when counts is empty."""
    if not counts:
        return []
    values = list(values)
    parts, start = [], 0
    for count in counts:
        parts.append(values[start:start + count])
        start += count
    return parts


def result_from_proto(msg: step_pb2.StepResult) -> StepResult:
    top_ids, top_logprobs = _split(msg.num_top, msg.top_token_ids), _split(msg.num_top, msg.top_logprobs)
    beam_ids, beam_logprobs = _split(msg.num_beam, msg.beam_token_ids), _split(msg.num_beam, msg.beam_logprobs)
    samples = [SeqSample(seq_id, token_id, logprob) for seq_id, token_id, logprob
               in zip(msg.seq_ids, msg.token_ids, msg.logprobs)]
    for sample, ids, logprobs in zip(samples, top_ids, top_logprobs):
        sample.top_token_ids, sample.top_logprobs = ids, logprobs
    for sample, ids, logprobs in zip(samples, beam_ids, beam_logprobs):
        sample.beam_token_ids, sample.beam_logprobs = ids, logprobs
    failures = [SeqFailure(seq_id, message) for seq_id, message in zip(msg.failed_seq_ids, msg.failure_messages)]
    return StepResult(step_id=msg.step_id, samples=samples, forward_seconds=msg.forward_seconds,
                      epoch=msg.epoch, failures=failures, failed_fetch_keys=list(msg.failed_fetch_keys),
                      num_steps=max(1, msg.num_steps), run_step=msg.run_step)


def encode_plan(plan: StepPlan) -> bytes:
    return step_pb2.SchedulerMessage(step_plan=plan_to_proto(plan)).SerializeToString()


def encode_result(result: StepResult) -> bytes:
    return step_pb2.WorkerMessage(step_result=result_to_proto(result)).SerializeToString()


def attach_masks(seqs: list[ScheduledSeq], token_bitmasks: bytes) -> None:
    """Splits the concatenated bitmask rows among seqs by their num_mask_rows."""
    row_bytes = len(token_bitmasks) // max(1, sum(seq.num_mask_rows for seq in seqs))
    start = 0
    for seq in seqs:
        end = start + seq.num_mask_rows * row_bytes
        seq.token_bitmask = token_bitmasks[start:end]
        start = end


def masks_to_proto(plan: StepPlan) -> step_pb2.StepMasks:
    """The StepMasks that follows a plan published with masks_follow."""
    return step_pb2.StepMasks(epoch=plan.epoch, step_id=plan.step_id,
                              token_bitmasks=b"".join(seq.token_bitmask for seq in plan.seqs))
