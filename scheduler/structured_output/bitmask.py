"""The token bitmask rows of one step, for its constrained sequences only.

A row is ceil(vocab_size / 32) little-endian int32 words; bit (id % 32) of word (id // 32) is set
when token id may be sampled. A constrained sequence that samples gets one row, or k + 1 rows
when it verifies k drafts (matcher.py); unconstrained sequences get none, so a step without
constraints carries no mask at all. The worker (worker/structured_output.py) sets the logits of
cleared bits to -inf before anything else touches them.
"""

from __future__ import annotations

import numpy as np

from pagedserve.scheduler.structured_output.matcher import SequenceMatcher


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def mask_rows(matcher: SequenceMatcher, vocab_size: int, drafts: list[int]) -> bytes:
    """The rows of one sampling sequence, as the bytes a ScheduledSeq carries."""
    rows = np.empty((len(drafts) + 1, num_words(vocab_size)), dtype=np.int32)  # [k + 1, words]
    if drafts:
        matcher.fill_draft_masks(rows, 0, drafts)
    else:
        matcher.fill_mask(rows, 0)
    return rows.tobytes()


def allowed_token_ids(row: bytes, vocab_size: int) -> np.ndarray:
    """The ids a row allows (for tests and inspection)."""
    bits = np.unpackbits(np.frombuffer(row, dtype=np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)
