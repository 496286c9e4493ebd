"""Speculative decoding, scheduler side: proposals joined to a step as extra scheduled tokens.

A decoding sequence normally computes one token (its last) and samples the next. With proposals
d1..dk appended to its token_ids it computes k + 1 tokens in the same forward and the worker
samples a row at each of them (verification, worker/speculation/ngram_verify.py):

    token_ids   [ ........ computed ........ | t | d1 d2 .. dk ]     num_draft_tokens = k
    this step                                 [ k + 1 new tokens ]  slots for all k + 1 positions

The drafts go through the ordinary chunk path (plan_chunks, BlockManager.append_slots), so
copy-on-write of a shared last block and new blocks come for free; they are never registered
in the prefix cache while in flight (StepBuilder.build skips drafting sequences), and the result
(spec_acceptance.py) removes them again, keeps the accepted ones and frees rejected slots.

With --speculative-method draft the proposals come from the workers' draft model: the scheduler
appends k placeholders (DRAFT_PLACEHOLDER) that the worker replaces with its draft model's
proposals before the target forward, and tells it which tokens the draft model has not computed
KV for yet (StepBuilder: draft_context_ids, from Sequence.num_draft_computed). Everything else
below (who, how many, budget, back-off, blocks) is the same for both methods:

    token_ids   [ ........ computed ........ | t | 0  0 .. 0  ]    placeholders, num_draft_tokens = k
    draft KV    [ computed ][ draft context ]  t  d1 .. d(k-1)     written by this step's draft forwards

Back-off: verifying k drafts is not free (k more rows in the forward), so a sequence whose
verification accepted nothing pauses proposing for 1, 2, 4, then at most MAX_PAUSE_STEPS decode
steps (consecutive misses double the pause; any accepted draft ends it). Open-ended text, where
proposals rarely match, then pays for few verifications; text that copies its input keeps
proposing while it copies. This only decides when to propose, never what is emitted.

Structured output: an n-gram proposal is cut before its first token the sequence's grammar
refuses (every verified row then has a mask, structured_output/sequences.py); with a draft model
constrained requests get no proposals.

Who drafts: every sequence of a running, non-beam group whose shared prefix is forked (n > 1
drafts per sample), in a step that starts with at most speculative_disable_batch_size running
sequences. How many: at most num_speculative_tokens, and never past the last output token the
request may produce (max_tokens, max_model_len); while min_tokens still suppresses the stop ids
only as many as keep every verified row on the same side of min_tokens, so the worker applies
one suppression to all rows. Proposals never exceed the step's token budget; a sequence whose
chunk is not scheduled whole drops its drafts before the plan is sent, and a group whose drafts
need blocks the pool lacks drops them all rather than preempt another group for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.scheduler.speculation.ngram_proposer import propose_ngram
from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup
from pagedserve.scheduler.structured_output.sequences import cut_drafts

if TYPE_CHECKING:
    from pagedserve.scheduler.core.scheduler import Scheduler
    from pagedserve.scheduler.core.chunk_planning import Chunk


MAX_PAUSE_STEPS = 8
DRAFT_PLACEHOLDER = 0  # a proposal slot the worker's draft model fills (--speculative-method draft)


def record_verification(seq: Sequence, num_accepted: int) -> None:
    """Updates seq's back-off after a verification that accepted num_accepted drafts."""
    if num_accepted:
        seq.num_spec_misses = 0
        return
    seq.num_spec_pauses_left = min(1 << seq.num_spec_misses, MAX_PAUSE_STEPS)
    seq.num_spec_misses += 1


class Drafter:
    """Adds proposals (n-gram, or placeholders for the worker's draft model) to the decoding
    sequences of running groups, for one step."""

    def __init__(self, scheduler: Scheduler) -> None:
        config = scheduler.config
        self.is_draft_model = config.is_draft_model_speculation
        self.num_speculative_tokens = config.num_speculative_tokens
        self.ngram_min = config.ngram_min
        self.ngram_max = config.ngram_max

    @staticmethod
    def for_step(scheduler: Scheduler) -> Drafter | None:
        """A Drafter when this step speculates, else None."""
        config = scheduler.config
        if not config.is_speculating:
            return None
        num_running_seqs = sum(len(group.seqs) for group in scheduler.running)
        if num_running_seqs > config.speculative_disable_batch_size:
            return None
        return Drafter(scheduler)

    def add_drafts(self, group: SequenceGroup, max_num_tokens: int) -> bool:
        """Appends proposals to the group's decoding sequences within max_num_tokens new tokens
        for the whole group (its plain decodes included); True when any sequence got some."""
        if group.beam is not None or group.fork_at is not None:
            return False
        if self.is_draft_model and group.request.sampling.is_constrained:
            return False  # served without proposals (counted as unspeculated on arrival)
        decoding = [seq for seq in group.seqs if len(seq.token_ids) - seq.num_computed_tokens == 1]
        budget = max_num_tokens - len(decoding)
        is_drafting = False
        for seq in decoding:
            if budget <= 0:
                break
            if seq.num_spec_pauses_left:
                seq.num_spec_pauses_left -= 1
                continue
            limit = min(self.num_speculative_tokens, budget, self._max_drafts(group, seq))
            if self.is_draft_model:
                drafts = [DRAFT_PLACEHOLDER] * max(limit, 0)
            else:
                drafts = cut_drafts(seq, propose_ngram(seq.token_ids, ngram_min=self.ngram_min,
                                                       ngram_max=self.ngram_max, max_num_tokens=limit))
            if drafts:
                seq.token_ids.extend(drafts)
                seq.num_draft_tokens = len(drafts)
                budget -= len(drafts)
                is_drafting = True
        return is_drafting

    @staticmethod
    def _max_drafts(group: SequenceGroup, seq: Sequence) -> int:
        sampling = group.request.sampling
        num_outputs = seq.num_output_tokens
        limit = group.max_output_tokens - num_outputs - 1  # the verified rows emit at most limit + 1 tokens
        if num_outputs < sampling.min_tokens and group.stop_token_ids:
            limit = min(limit, sampling.min_tokens - num_outputs - 1)
        return limit


def drop_unscheduled_drafts(group: SequenceGroup, chunks: list[Chunk]) -> bool:
    """Drops the drafts of sequences whose chunk does not verify all of them; True if any did."""
    scheduled = {id(chunk.seq): chunk for chunk in chunks}
    is_dropped = False
    for seq in group.seqs:
        if not seq.num_draft_tokens:
            continue
        chunk = scheduled.get(id(seq))
        if chunk is None or not chunk.is_sampling:
            seq.drop_drafts()
            is_dropped = True
    return is_dropped


def drop_group_drafts(group: SequenceGroup) -> None:
    for seq in group.seqs:
        seq.drop_drafts()
