"""A group's new tokens for one step, cut into chunks within the step's token and sequence
budget (chunked prefill; a beam group's beams together). StepBuilder emits them."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    num_tokens: int
    is_sampling: bool


def plan_chunks(group: SequenceGroup, max_num_tokens: int, max_num_seqs: int) -> list[Chunk]:
    """What each runnable sequence of the group computes now: decodes first, then prefill
    chunks in sequence order, within max_num_tokens tokens and max_num_seqs sequences."""
    seqs = group.runnable_seqs()
    if group.beam is not None and len(group.seqs) > 1:
        return _plan_beam_chunks(group, seqs, max_num_tokens, max_num_seqs)
    chunks: list[Chunk] = []
    prefills: list[tuple[Sequence, int, int]] = []
    for seq in seqs:
        target = group.prefill_target(seq)
        uncomputed = target - seq.num_computed_tokens
        if uncomputed == 1:
            if max_num_tokens < 1 or max_num_seqs < 1:
                break
            chunks.append(Chunk(seq, 1, target == len(seq.token_ids)))
            max_num_tokens -= 1
            max_num_seqs -= 1
        elif uncomputed > 1:
            prefills.append((seq, target, uncomputed))
    for seq, target, uncomputed in prefills:
        if max_num_tokens < 1 or max_num_seqs < 1:
            break
        num_tokens = min(uncomputed, max_num_tokens)
        chunks.append(Chunk(seq, num_tokens, seq.num_computed_tokens + num_tokens == len(seq.token_ids)))
        max_num_tokens -= num_tokens
        max_num_seqs -= 1
    return chunks


def _plan_beam_chunks(group: SequenceGroup, seqs: list[Sequence], max_num_tokens: int,
                      max_num_seqs: int) -> list[Chunk]:
    tails = [len(seq.token_ids) - seq.num_computed_tokens for seq in seqs]
    if group.fork_at is None and len(seqs) <= max_num_seqs and sum(tails) <= max_num_tokens:
        return [Chunk(seq, tail, True) for seq, tail in zip(seqs, tails) if tail > 0]
    chunks = []
    for seq in seqs:  # with a fork pending only the leader runs, up to fork_at (< its length)
        target = group.fork_at if group.fork_at is not None else len(seq.token_ids) - 1
        uncomputed = target - seq.num_computed_tokens
        if uncomputed <= 0:
            continue
        if max_num_tokens < 1 or max_num_seqs < 1:
            break
        num_tokens = min(uncomputed, max_num_tokens)
        chunks.append(Chunk(seq, num_tokens, False))
        max_num_tokens -= num_tokens
        max_num_seqs -= 1
    return chunks


def num_decode_tokens(group: SequenceGroup) -> int:
    """Tokens the group's decodes take this step (reserved before any prefill chunk)."""
    if group.fork_at is not None:
        return 1 if group.fork_at - group.seqs[0].num_computed_tokens == 1 else 0
    num_tokens = 0
    for seq in group.seqs:
        if len(seq.token_ids) - seq.num_computed_tokens == 1:
            num_tokens += 1
    return num_tokens
