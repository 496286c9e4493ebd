"""One constrained sequence's matcher, kept in step with the sequence's output tokens.

    token_ids   [ prompt | outputs o1 .. om | drafts d1 .. dk ]
    matcher     has consumed o1 .. om exactly (num_consumed == m); drafts never stay consumed

Every token appended to the sequence's outputs is consumed (OutputProcessor); preemption
(swap or recompute), prefix-cache hits, chunked prefill and worker restarts keep the outputs,
so they leave the matcher alone; n > 1 gives each sample its own matcher from the compiled
template; a request resumed after a scheduler loss replays its generated tokens (catch_up).

Masks: a sampling row's mask allows exactly the tokens the grammar accepts next (EOS once the
grammar is complete; only EOS once it cannot continue). A sequence verifying drafts needs one
mask per verified row: the mask before d1, after d1, ... after dk, computed by consuming the
drafts and rolling them back (draft_masks). A proposal is cut at its first token the grammar
rejects (valid_draft_prefix), so every draft a row verifies was possible there.
"""

from __future__ import annotations

import llguidance
import numpy as np


class MatcherError(RuntimeError):
    """A token reached a matcher that refuses it (the mask was not applied)."""


class SequenceMatcher:
    __slots__ = ("matcher", "num_consumed")

    def __init__(self, matcher: llguidance.LLMatcher, num_consumed: int = 0) -> None:
        self.matcher = matcher
        self.num_consumed = num_consumed

    def fork(self) -> SequenceMatcher:
        return SequenceMatcher(self.matcher.deep_copy(), self.num_consumed)

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Consumes the outputs past num_consumed (a resumed request's generated tokens)."""
        pending = output_token_ids[self.num_consumed:]
        if pending:
            self.consume(pending)

    def consume(self, token_ids: list[int]) -> None:
        if self.matcher.is_stopped():
            # past a complete value only EOS was allowed (ignore_eos keeps the sequence going)
            self.num_consumed += len(token_ids)
            return
        if not self.matcher.consume_tokens(token_ids):
            raise MatcherError(f"the grammar refuses token(s) {token_ids}: {self.matcher.get_error()}")
        self.num_consumed += len(token_ids)

    @property
    def is_complete(self) -> bool:
        """The output so far is a complete value (EOS is allowed now)."""
        return self.matcher.is_accepting()

    def valid_draft_prefix(self, drafts: list[int]) -> int:
        """How many leading proposals the grammar accepts from here."""
        if not drafts or self.matcher.is_stopped():
            return 0
        return self.matcher.validate_tokens(drafts)

    def fill_mask(self, rows: np.ndarray, index: int) -> None:
        """Writes the mask of the next token into rows[index] (int32 words, bit i = token i)."""
        row = rows[index]
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def fill_draft_masks(self, rows: np.ndarray, start: int, drafts: list[int]) -> None:
        """Masks of the len(drafts) + 1 verified rows into rows[start:]; the matcher ends as it began."""
        self.fill_mask(rows, start)
        for offset, token_id in enumerate(drafts, 1):
            if not self.matcher.consume_token(token_id):
                raise MatcherError(f"draft token {token_id} is refused: {self.matcher.get_error()}")
            self.fill_mask(rows, start + offset)
        if drafts and not self.matcher.rollback(len(drafts)):
            raise MatcherError(f"cannot roll back {len(drafts)} draft tokens: {self.matcher.get_error()}")
