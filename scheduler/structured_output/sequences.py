"""Where the scheduler core meets structured output: matchers attached to a new group, the mask
rows of a sampling sequence, proposals cut to what the grammar accepts, tokens consumed.

    add_request       attach_matchers: one matcher per sequence from the compiled template; a
                      resumed request's sequences replay their generated tokens (catch_up)
    drafting          cut_drafts: an n-gram proposal ends before its first refused token
    step plan         fill_masks: rows for the sequence's sampled rows (1 + drafts)
    result            consume_output: each appended output token, in order
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.contracts.step_plan import ScheduledSeq
from pagedserve.scheduler.core.errors import RequestRejected
from pagedserve.scheduler.structured_output.bitmask import mask_rows
from pagedserve.scheduler.structured_output.compiler import GrammarError
from pagedserve.scheduler.structured_output.matcher import MatcherError, SequenceMatcher

if TYPE_CHECKING:
    from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup
    from pagedserve.scheduler.structured_output.compiler import GrammarCompiler


def attach_matchers(group: SequenceGroup, grammars: GrammarCompiler | None) -> None:
    """Gives every sequence of a constrained group its matcher; RequestRejected when the
    constraint does not compile or a resumed sequence's tokens break it."""
    constraint = group.request.sampling.constraint
    if constraint is None:
        return
    request_id = group.request_id
    if grammars is None:
        raise RequestRejected(request_id, "structured output is not available on this scheduler")
    try:
        template = grammars.template(constraint)
    except GrammarError as error:
        raise RequestRejected(request_id, str(error)) from error
    for seq in group.seqs:
        seq.matcher = SequenceMatcher(template.deep_copy())
        try:
            seq.matcher.catch_up(seq.output_token_ids)
        except MatcherError as error:
            raise RequestRejected(request_id, f"completion {seq.output_index} cannot continue: {error}") from error


def cut_drafts(seq: Sequence, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the sequence's grammar accepts after its outputs."""
    if seq.matcher is None or not drafts:
        return drafts
    return drafts[:seq.matcher.valid_draft_prefix(drafts)]


def fill_masks(scheduled: ScheduledSeq, seq: Sequence, vocab_size: int) -> None:
    """Attaches the mask rows of a constrained sampling sequence to its ScheduledSeq."""
    drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens:] if seq.num_draft_tokens else []
    scheduled.num_mask_rows = len(drafts) + 1
    scheduled.token_bitmask = mask_rows(seq.matcher, vocab_size, drafts)


def consume_output(seq: Sequence, token_id: int) -> None:
    """Advances the matcher over an output token just appended (raises MatcherError if refused)."""
    seq.matcher.consume([token_id])
