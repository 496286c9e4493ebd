"""Beam search, step for step as Hugging Face transformers (5.x) `GenerationMixin._beam_search`
does it with its defaults (early_stopping=False, do_sample=False, num_return_sequences=k).

One step, for k = beam_width and K = max(2, 1 + number of stop ids) * k candidates:

    running beams (best first)      candidates from the worker (best first, K per beam)
    b0  score s0  ─┐                (t, logprob) ... ─┐
    b1  score s1  ─┼── s_b + logprob(t) for every (b, t) ──> top K overall (`_get_top_k_continuations`)
    ...           ─┘                                    │
                                                        ├─ next running beams: the best k that do
                                                        │  not stop (`_get_running_beams_for_next_iteration`)
                                                        └─ finished hypotheses: those among the best k
                                                           (by raw score) that stop, scored
                                                           s / num_generated ** length_penalty, merged
                                                           with the earlier ones, best k kept
                                                           (`_update_finished_beams`)

"Stops" means the new token is a stop id or the hypothesis reaches max_new_tokens (HF's
EosTokenCriteria and MaxLengthCriteria on the candidate sequences). num_generated counts the new
token (HF: cur_len + 1 - decoder_prompt_len). Only the first beam is live at the start (HF seeds
the other k - 1 beams with -1e9; they never win): here the prompt is one sequence with score 0.

The search ends (`_beam_search_has_unfinished_sequences`) when every top-K candidate stops, or
when the early-stop heuristic (`_check_early_stop_heuristic`, early_stopping=False) says no
running beam can improve: all k hypothesis slots are filled and
best running score / num_generated ** length_penalty <= worst finished score. The outputs are
the k hypotheses, best first (HF's `sequences[:, :num_return_sequences]`, without padding).

Scores are rounded to float32 after every operation, as HF's float32 tensors are (divisions as
on CPU: both operands in float32). Ties are broken by beam order, then candidate order.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.contracts.request_types import TokenLogprob

NEG_SCORE = -1.0e9  # HF's stand-in for "never": seeded beams, stopped beams, empty slots
_FLOAT32 = struct.Struct("<f")


def f32(value: float) -> float:
    """value rounded to the nearest float32."""
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


@dataclass(slots=True)
class BeamCandidate:
    beam_index: int  # parent's position among the running beams
    token_id: int
    logprob: float  # log_softmax of token_id under the parent's distribution
    score: float  # parent score + logprob: the sum of the hypothesis' logprobs
    is_stopping: bool = False


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]  # generated tokens, the stopping one included
    score: float  # HF sequences_scores: sum of logprobs / len(token_ids) ** length_penalty
    is_stopped_by_token: bool  # ended with a stop id (else by length)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class BeamStepResult:
    continuations: list[BeamCandidate]  # the next running beams, best first (empty when done)
    is_done: bool


def num_beam_candidates(beam_width: int, num_stop_ids: int) -> int:
    """HF's beams_to_keep: enough candidates that k of them never stop."""
    return max(2, 1 + num_stop_ids) * beam_width


def top_candidates(running_scores: list[float], candidates: list[list[tuple[int, float]]],
                   num_to_keep: int) -> list[BeamCandidate]:
    """The num_to_keep best (beam, token) continuations by accumulated score, best first."""
    pool: list[BeamCandidate] = []
    for beam_index, (score, beam_candidates) in enumerate(zip(running_scores, candidates)):
        for token_id, logprob in beam_candidates[:num_to_keep]:
            logprob = f32(logprob)
            pool.append(BeamCandidate(beam_index, token_id, logprob, f32(score + logprob)))
    pool.sort(key=lambda candidate: -candidate.score)  # stable: ties keep beam, then candidate order
    return pool[:num_to_keep]


def length_normalised(score: float, num_generated: int, length_penalty: float) -> float:
    try:
        return f32(score / f32(num_generated ** length_penalty))
    except (OverflowError, ZeroDivisionError):  # |length_penalty| far beyond what a request may ask
        return NEG_SCORE


class BeamSearchState:
    """Scores and finished hypotheses of one request's beam search; the caller owns the beams."""

    def __init__(self, *, beam_width: int, length_penalty: float, max_new_tokens: int,
                 stop_token_ids: frozenset[int]) -> None:
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.num_candidates = num_beam_candidates(beam_width, len(stop_token_ids))
        self.running_scores: list[float] = [0.0]  # aligned with the caller's running beams
        self.finished: list[BeamHypothesis] = []  # best first, at most beam_width
        self.num_generated = 0  # tokens every running beam has generated
        self.is_improvement_possible = True
        self.is_done = False

    def step(self, candidates: list[list[tuple[int, float]]],
             make_hypothesis: Callable[[BeamCandidate, float], BeamHypothesis]) -> BeamStepResult:
        """Advances one token. candidates[i] are running beam i's (token, logprob), best first;
        make_hypothesis(candidate, normalised score) snapshots a stopping candidate's beam."""
        if self.is_done:
            raise ValueError("beam search already finished")
        if len(candidates) != len(self.running_scores):
            raise ValueError(f"{len(candidates)} candidate lists for {len(self.running_scores)} beams")
        k = self.beam_width
        num_generated = self.num_generated + 1
        is_at_max_length = num_generated >= self.max_new_tokens
        top = top_candidates(self.running_scores, candidates, self.num_candidates)
        for candidate in top:
            candidate.is_stopping = is_at_max_length or candidate.token_id in self.stop_token_ids

        continuations = [candidate for candidate in top if not candidate.is_stopping][:k]
        new_hypotheses = [make_hypothesis(candidate, length_normalised(candidate.score, num_generated,
                                                                       self.length_penalty))
                          for candidate in top[:k] if candidate.is_stopping]
        if new_hypotheses:
            merged = self.finished + new_hypotheses
            merged.sort(key=lambda hypothesis: -hypothesis.score)  # stable: earlier ones win ties
            self.finished = merged[:k]

        self.num_generated = num_generated
        if continuations:
            best = length_normalised(continuations[0].score, num_generated, self.length_penalty)
            worst = min(h.score for h in self.finished) if len(self.finished) == k else NEG_SCORE
            self.is_improvement_possible = self.is_improvement_possible and best > worst
        has_valid_continuation = not all(candidate.is_stopping for candidate in top)
        self.is_done = not (self.is_improvement_possible and has_valid_continuation and continuations)
        if self.is_done:
            self.running_scores = []
            return BeamStepResult(continuations=[], is_done=True)
        self.running_scores = [candidate.score for candidate in continuations]
        return BeamStepResult(continuations=continuations, is_done=False)
