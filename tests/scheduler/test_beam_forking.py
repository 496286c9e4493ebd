"""Beam forking: continuations grow their parents in place or fork them, unextended parents end."""

from __future__ import annotations

from pagedserve.contracts.request_types import TokenLogprob
from pagedserve.scheduler.beam.forking import fork_beams
from pagedserve.scheduler.beam.search import BeamCandidate
from pagedserve.scheduler.kv.block_manager import BlockManager
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import Sequence


def _beams(manager: BlockManager, last_tokens: list[int]) -> list[Sequence]:
    """Beams of 5 computed tokens (two blocks of 4, the second partly filled) ending in last_tokens."""
    beams = []
    for index, last in enumerate(last_tokens):
        beam = Sequence(seq_id=index, output_index=0, token_ids=[1, 2, 3, 4, last], num_prompt_tokens=4)
        manager.append_slots(beam, 5, [])
        beam.num_computed_tokens = 5
        beams.append(beam)
    return beams


def test_the_docstring_example() -> None:
    manager = BlockManager(SchedulerConfig(num_gpu_blocks=16, max_model_len=64, block_size=4))
    parents = _beams(manager, [4, 8, 6])
    b0, b1, b2 = parents
    b0_blocks, b1_blocks = list(b0.block_table), list(b1.block_table)
    continuations = [BeamCandidate(0, 7, -0.5, -0.5), BeamCandidate(2, 3, -1.0, -1.0),
                     BeamCandidate(0, 5, -2.0, -2.0)]
    new_ids = iter([10])
    logprobs = {7: TokenLogprob(7, -0.5), 3: TokenLogprob(3, -1.0), 5: TokenLogprob(5, -2.0)}

    beams = fork_beams(parents, continuations, manager, lambda: next(new_ids),
                       lambda candidate: logprobs[candidate.token_id])

    assert beams[0] is b0 and beams[1] is b2 and beams[2].seq_id == 10
    assert [beam.token_ids[-2:] for beam in beams] == [[4, 7], [6, 3], [4, 5]]
    assert [beam.cumulative_logprob for beam in beams] == [-0.5, -1.0, -2.0]
    assert [beam.output_logprobs[-1].token_id for beam in beams] == [7, 3, 5]
    assert beams[2].block_table == b0_blocks  # shared with b0 until one of them writes
    assert all(manager.gpu_pool.ref_counts[block] == 2 for block in b0_blocks)
    assert b1.block_table == [] and all(manager.gpu_pool.ref_counts[block] == 0 for block in b1_blocks)


def test_without_logprobs_nothing_is_recorded() -> None:
    manager = BlockManager(SchedulerConfig(num_gpu_blocks=8, max_model_len=64, block_size=4))
    beams = fork_beams(_beams(manager, [4]), [BeamCandidate(0, 7, -0.5, -0.5), BeamCandidate(0, 9, -1.0, -1.0)],
                       manager, iter([5]).__next__)
    assert [beam.output_logprobs for beam in beams] == [[], []]
    assert [beam.token_ids[-1] for beam in beams] == [7, 9]
