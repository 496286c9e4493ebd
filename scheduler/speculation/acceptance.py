"""Speculative decoding, scheduler side: the verified result of a drafting sequence.

The worker answers a sequence that verified k drafts with the tokens it emits, in order: the
accepted drafts d1..da (a <= k), then one more token, drawn where d(a+1) was rejected or, when
all k were accepted, the bonus token after dk (worker/speculation/ngram_verify.py). Here:

    before    token_ids [ ... t | d1 .. dk ]   computed up to dk (this step wrote k + 1 slots)
    drafts    removed from token_ids; a accepted drafts keep their KV
    KV        computed = position of t + 1 + a; blocks past it held only rejected slots: freed
    tokens    appended one at a time with the usual stops (EOS and stop ids after min_tokens,
              max_tokens): a stop truncates the rest
    prefix    full blocks registered now, from the final tokens (a rejected token is never hashed)

With a draft model (StepPlan.drafts_from_worker) the drafts in token_ids are placeholders: the
emitted tokens cannot be compared with them, only 0 <= a <= k is checked. The draft model wrote
its KV for t, d1 .. d(k-1) in this step (dk was never fed to it), so of the kept positions it has
computed those up to t + min(a, k - 1):

    num_draft_computed = position of t + 1 + min(a, k - 1)     (<= num_computed_tokens)

Stop strings stay with the frontend, which ends a completion mid-delta as for any delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.contracts.request_types import CompletionDelta
from pagedserve.scheduler.core.errors import StepOrderError
from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup
from pagedserve.scheduler.speculation.drafting import record_verification
from pagedserve.contracts.step_plan import SeqSample

if TYPE_CHECKING:
    from pagedserve.scheduler.core.output_processor import OutputProcessor


@dataclass(slots=True)
class SpecDecodeStats:
    """Running totals: verified sequences, proposed and accepted tokens, accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_position: list[int] = field(default_factory=list)  # [i]: d(i+1) accepted
    num_beam_search_requests: int = 0  # requests served without speculation: beam search, or
    # constrained ones under draft-model speculation

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_position = self.num_accepted_per_position
        if len(per_position) < num_accepted:
            per_position.extend([0] * (num_accepted - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1


def apply_verified(processor: OutputProcessor, group: SequenceGroup, seq: Sequence,
                   samples: list[SeqSample], *, drafts_from_worker: bool = False) -> CompletionDelta:
    """Applies the tokens the worker emitted for a drafting sequence; returns their delta.
    drafts_from_worker: the step's drafts were placeholders for the worker's draft model."""
    scheduler = processor.scheduler
    manager = scheduler.block_manager
    num_drafts = seq.num_draft_tokens
    drafts = seq.token_ids[len(seq.token_ids) - num_drafts:]
    seq.drop_drafts()
    num_accepted = len(samples) - 1
    if not 0 <= num_accepted <= num_drafts or not drafts_from_worker and any(
            sample.token_id != draft for sample, draft in zip(samples[:num_accepted], drafts)):
        raise StepOrderError(f"sequence {seq.seq_id}: {len(samples)} tokens do not verify {num_drafts} drafts")
    scheduler.spec_stats.record(num_drafts, num_accepted)
    record_verification(seq, num_accepted)
    seq.num_computed_tokens = len(seq.token_ids) + num_accepted  # the last real token and the accepted drafts
    if drafts_from_worker:
        seq.num_draft_computed = len(seq.token_ids) + min(num_accepted, num_drafts - 1)
    manager.truncate(seq)
    token_ids, logprobs = [], []
    delta = None
    for sample in samples:
        delta = processor._append(group, seq, sample)
        token_ids += delta.token_ids
        logprobs += delta.logprobs
        if delta.finish_reason is not None:
            break
    if not seq.is_finished:
        manager.prefix_cache.register_computed(seq)
    return CompletionDelta(seq.output_index, token_ids, logprobs, delta.cumulative_logprob, delta.finish_reason)
