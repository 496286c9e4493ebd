"""Prompt-lookup (n-gram) proposals: the tokens that followed an earlier occurrence of the
context's suffix in the sequence's own tokens.

    tokens   ... a b c d e ........ x a b c   <- suffix "a b c" (n = 3, ngram_min <= n <= ngram_max)
                 ^^^^^ earlier match, followed by "d e ..."       -> propose d, e, ... (up to K)

The longest suffix (up to ngram_max, at least ngram_min tokens) that occurs earlier wins; among
equally long matches the most recent one. Text that copies its input (rewriting, summarising,
editing code) repeats long runs of the prompt, so the proposals are often right; when they are
not, verification rejects them and the output is unchanged (spec_acceptance.py).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], *, ngram_min: int, ngram_max: int, max_num_tokens: int) -> list[int]:
    """Up to max_num_tokens proposed next tokens ([] when no suffix of ngram_min tokens recurs)."""
    num_tokens = len(token_ids)
    if max_num_tokens <= 0 or num_tokens < ngram_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
    last = num_tokens - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # [C] earlier positions matching the last token
    if ends.size == 0:
        return []
    lengths = np.ones(ends.size, dtype=np.int64)  # [C] length of the match ending at each candidate
    alive = np.ones(ends.size, dtype=bool)  # [C] still matching at this offset
    for offset in range(1, min(ngram_max, last)):
        earlier = ends - offset  # [C]
        alive &= earlier >= 0
        alive[alive] = tokens[earlier[alive]] == tokens[last - offset]
        if not alive.any():
            break
        lengths += alive
    lengths = np.minimum(lengths, ngram_max)
    best = int(lengths.max())
    if best < ngram_min:
        return []
    end = int(ends[np.flatnonzero(lengths == best)[-1]])  # the most recent of the longest matches
    return tokens[end + 1:end + 1 + max_num_tokens].tolist()
