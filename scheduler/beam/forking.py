"""Beam forking: the sequences of a beam search's next step, from the continuations it kept.

Each continuation (beam_search.py) extends one running beam, its parent, by one token. A parent's
first continuation grows the parent in place; each further one forks a new sequence that shares
the parent's blocks (copy-on-write at the first write into a shared partial block); a parent that
no continuation extends ends, and its blocks are released.

    running beams     continuations, best first     next beams, in continuation order
    b0 [ ... 4 ]      (b0, 7)                       b0 [ ... 4 7 ]   b0 grows in place
    b1 [ ... 8 ]      (b2, 3)                       b2 [ ... 6 3 ]   b2 grows in place
    b2 [ ... 6 ]      (b0, 5)                       c  [ ... 4 5 ]   c forks off b0
                                                    b1: freed
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.contracts.request_types import TokenLogprob
from pagedserve.scheduler.beam.search import BeamCandidate
from pagedserve.scheduler.kv.block_manager import BlockManager
from pagedserve.scheduler.core.sequence import Sequence


def fork_beams(parents: list[Sequence], continuations: list[BeamCandidate], manager: BlockManager,
               new_seq_id: Callable[[], int],
               logprob_of: Callable[[BeamCandidate], TokenLogprob] | None = None) -> list[Sequence]:
    """The next running beams, one per continuation and in its order; logprob_of, when given,
    makes each beam record its new token's logprob."""
    children: list[tuple[Sequence, BeamCandidate]] = []
    claimed: set[int] = set()
    for candidate in continuations:
        parent = parents[candidate.beam_index]
        if candidate.beam_index in claimed:
            child = parent.copy_as(new_seq_id(), 0)
            manager.fork(parent, child)
        else:
            claimed.add(candidate.beam_index)
            child = parent
        children.append((child, candidate))
    for index, parent in enumerate(parents):
        if index not in claimed:
            manager.free(parent)
    for child, candidate in children:  # parents were copied above, before any of them grows
        child.token_ids.append(candidate.token_id)
        child.cumulative_logprob += candidate.logprob
        if logprob_of is not None:
            child.output_logprobs.append(logprob_of(candidate))
    return [child for child, _ in children]
