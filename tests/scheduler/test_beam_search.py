"""Beam search selection against hand-computed cases (the rules of HF's `_beam_search`)."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.beam.search import (NEG_SCORE, BeamCandidate, BeamHypothesis, BeamSearchState, f32,
                                              length_normalised, num_beam_candidates, top_candidates)


class Beams:
    """Tracks the generated tokens of each running beam the way the scheduler does."""

    def __init__(self, state: BeamSearchState) -> None:
        self.state = state
        self.tokens: list[list[int]] = [[]]

    def step(self, candidates: list[list[tuple[int, float]]]) -> bool:
        def make(candidate: BeamCandidate, score: float) -> BeamHypothesis:
            return BeamHypothesis(token_ids=self.tokens[candidate.beam_index] + [candidate.token_id],
                                  score=score, is_stopped_by_token=candidate.token_id in self.state.stop_token_ids)

        result = self.state.step(candidates, make)
        self.tokens = [self.tokens[c.beam_index] + [c.token_id] for c in result.continuations]
        return result.is_done


def _finished(state: BeamSearchState) -> list[tuple[list[int], float]]:
    return [(h.token_ids, h.score) for h in state.finished]


def test_num_beam_candidates_follows_hf_beams_to_keep() -> None:
    assert num_beam_candidates(2, 0) == 4
    assert num_beam_candidates(2, 1) == 4
    assert num_beam_candidates(2, 2) == 6
    assert num_beam_candidates(3, 3) == 12


def test_top_candidates_sum_scores_in_float32_and_break_ties_by_beam_then_rank() -> None:
    top = top_candidates([0.0, -1.0], [[(5, -1.0), (6, -2.0)], [(7, 0.0), (8, -0.5)]], 3)
    assert [(c.beam_index, c.token_id) for c in top] == [(0, 5), (1, 7), (1, 8)]  # (0,5) ties (1,7)
    assert [c.score for c in top] == [-1.0, -1.0, -1.5]
    assert top_candidates([0.1], [[(1, 0.2)]], 1)[0].score == f32(f32(0.1) + f32(0.2))


def test_eos_handling_ranking_and_early_stop() -> None:
    state = BeamSearchState(beam_width=2, length_penalty=1.0, max_new_tokens=10, stop_token_ids=frozenset({0}))
    beams = Beams(state)
    # Step 1: only the prompt's beam is live. EOS (rank 2 of 4, inside the top k) finishes [0].
    assert not beams.step([[(5, -0.5), (0, -1.0), (6, -1.5), (7, -2.0)]])
    assert beams.tokens == [[5], [6]]
    assert _finished(state) == [([0], -1.0)]
    # Step 2: (b0, EOS) is ranked first -> [5, 0] scores -0.6 / 2. (b1, EOS) is ranked 4th, outside
    # the top k, so it is dropped although it stops.
    assert not beams.step([[(0, -0.1), (8, -0.2), (9, -3.0), (10, -3.1)],
                           [(11, -0.05), (0, -0.3), (12, -4.0), (13, -4.5)]])
    assert beams.tokens == [[5, 8], [6, 11]]
    assert _finished(state) == [([5, 0], pytest.approx(-0.3)), ([0], -1.0)]
    # Step 3: beam 1's continuation overtakes; no EOS in the top k. Best running -1.65 / 3 > worst -1.
    assert not beams.step([[(14, -2.0), (15, -2.1), (0, -2.2), (16, -2.3)],
                           [(17, -0.1), (0, -3.0), (18, -3.1), (19, -3.2)]])
    assert beams.tokens == [[6, 11, 17], [5, 8, 14]]
    assert state.running_scores == [pytest.approx(-1.65), pytest.approx(-2.7)]
    # Step 4: [6, 11, 17, 0] scores -2.65 / 4 and pushes [0] out; the best running beam can reach
    # only -2.85 / 4 < worst finished -0.6625: the search is over.
    assert beams.step([[(0, -1.0), (19, -1.2), (20, -5.0), (21, -6.0)],
                       [(18, -0.5), (22, -0.6), (0, -0.7), (23, -9.0)]])
    assert _finished(state) == [([5, 0], pytest.approx(-0.3)), ([6, 11, 17, 0], pytest.approx(-0.6625))]
    assert state.is_done
    with pytest.raises(ValueError):
        state.step([], lambda candidate, score: None)


def test_max_length_finishes_the_top_k_with_length_penalty() -> None:
    for length_penalty, divisor in ((1.0, 2.0), (2.0, 4.0), (0.0, 1.0)):
        state = BeamSearchState(beam_width=2, length_penalty=length_penalty, max_new_tokens=2,
                                stop_token_ids=frozenset())
        beams = Beams(state)
        assert not beams.step([[(1, -0.1), (2, -0.2), (3, -0.3), (4, -0.4)]])
        assert beams.step([[(5, -1.0), (6, -2.0), (9, -7.0), (10, -8.0)],
                           [(7, -0.5), (8, -3.0), (11, -7.0), (12, -8.0)]])
        assert _finished(state) == [([2, 7], pytest.approx(-0.7 / divisor)), ([1, 5], pytest.approx(-1.1 / divisor))]
        assert all(not h.is_stopped_by_token for h in state.finished)


def test_length_penalty_lets_a_longer_hypothesis_win() -> None:
    state = BeamSearchState(beam_width=2, length_penalty=1.0, max_new_tokens=3, stop_token_ids=frozenset({0}))
    beams = Beams(state)
    assert not beams.step([[(0, -1.0), (1, -1.1), (2, -1.2), (3, -5.0)]])  # [0] finishes at -1.0
    assert not beams.step([[(4, -0.5), (5, -0.6), (6, -6.0), (7, -7.0)],
                           [(8, -0.4), (9, -6.0), (10, -7.0), (11, -8.0)]])
    # beams: [1, 4] -1.6 and [2, 8] -1.6 (tie: beam order kept); max length at step 3
    assert beams.tokens == [[1, 4], [2, 8]]
    assert beams.step([[(12, -0.3), (13, -0.4), (14, -8.0), (15, -9.0)],
                       [(16, -0.2), (17, -0.9), (18, -8.0), (19, -9.0)]])
    # [1, 4, 12] -1.9 / 3 and [2, 8, 16] -1.8 / 3 both beat the short [0] at -1.0
    assert _finished(state) == [([2, 8, 16], pytest.approx(-0.6)), ([1, 4, 12], pytest.approx(-1.9 / 3))]


def test_heuristic_uses_current_length_even_with_negative_length_penalty() -> None:
    state = BeamSearchState(beam_width=1, length_penalty=-1.0, max_new_tokens=10, stop_token_ids=frozenset({0}))
    beams = Beams(state)
    # k=1, two candidates per step. EOS is ranked 2nd, outside the top k = 1: not a hypothesis.
    assert not beams.step([[(3, -1.0), (0, -2.0)]])
    assert _finished(state) == []
    # [3, 0] finishes with -1.5 / 2 ** -1 = -3.0; the running [3, 4] at -1.6 can reach only
    # -1.6 / 2 ** -1 = -3.2 at the current length (HF does not extrapolate for early_stopping=False).
    assert beams.step([[(0, -0.5), (4, -0.6)]])
    assert _finished(state) == [([3, 0], pytest.approx(-3.0))]
    assert state.is_done


def test_candidate_lists_must_match_running_beams() -> None:
    state = BeamSearchState(beam_width=2, length_penalty=1.0, max_new_tokens=4, stop_token_ids=frozenset())
    with pytest.raises(ValueError):
        state.step([[(1, -1.0)], [(2, -1.0)]], lambda candidate, score: None)


def test_length_normalised_matches_hf_formula() -> None:
    assert length_normalised(-3.0, 3, 1.0) == pytest.approx(-1.0)
    assert length_normalised(-3.0, 4, 0.5) == pytest.approx(-1.5)
    assert length_normalised(-3.0, 2, -1.0) == pytest.approx(-6.0)
    assert NEG_SCORE == -1.0e9


def test_length_normalised_survives_an_overflowing_length_penalty() -> None:
    assert length_normalised(-3.0, 7, 1e30) == NEG_SCORE
    assert length_normalised(-3.0, 7, -1e30) == NEG_SCORE
