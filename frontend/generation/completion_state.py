"""One completion (one output index) of a request as the frontend sees it: token ids from the
scheduler in, text pieces with stop strings applied out."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.frontend.tokenization.detokenizer import Decoder, IncrementalDetokenizer
from pagedserve.frontend.generation.stop_strings import StopStringMatcher
from pagedserve.contracts.request_types import CompletionDelta, FinishReason, TokenLogprob
from pagedserve.contracts.sampling_params import SamplingParams


class CompletionFinish(enum.Enum):
    """Why a completion ended, as the public API reports it."""

    LENGTH = "length"
    STOP = "stop"  # EOS or a stop token id
    STOP_SEQUENCE = "stop_sequence"


class SchedulerAbortedCompletion(RuntimeError):
    """The scheduler ended a completion as aborted although the frontend did not ask it to."""


@dataclass(slots=True)
class CompletionUpdate:
    """What one completion gained from one scheduler message (beam search: all of it, once)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish: CompletionFinish | None = None
    stop_sequence: str | None = None
    is_stopped_by_frontend: bool = False  # a stop string ended it: the scheduler must be told

    def merge(self, later: CompletionUpdate) -> None:
        """Appends a later update of the same index to this one."""
        if later.index != self.index:
            raise ValueError(f"cannot merge index {later.index} into index {self.index}")
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        self.cumulative_logprob = later.cumulative_logprob
        self.finish = later.finish or self.finish
        self.stop_sequence = later.stop_sequence or self.stop_sequence
        self.is_stopped_by_frontend = self.is_stopped_by_frontend or later.is_stopped_by_frontend

    @property
    def is_empty(self) -> bool:
        return not self.text and not self.token_ids and self.finish is None


_SCHEDULER_FINISH = {FinishReason.LENGTH: CompletionFinish.LENGTH, FinishReason.STOP: CompletionFinish.STOP}


class CompletionState:
    """Detokenizes one completion incrementally and applies stop strings to its text.

    Once finished (by the scheduler or by a stop string) it ignores further deltas: tokens the
    scheduler produced before it learnt about a stop string are dropped.
    """

    def __init__(self, index: int, params: SamplingParams, decoder: Decoder) -> None:
        self.index = index
        self._params = params
        self._detokenizer = IncrementalDetokenizer(decoder)
        self._matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.cumulative_logprob = 0.0
        self.finish: CompletionFinish | None = None
        self.stop_sequence: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish is not None

    def apply(self, delta: CompletionDelta) -> CompletionUpdate | None:
        """Takes one delta of this index; returns what it adds, or None once finished."""
        if delta.index != self.index:
            raise ValueError(f"delta for index {delta.index} given to completion {self.index}")
        if self.is_finished:
            return None
        if delta.finish_reason is FinishReason.ABORT:
            raise SchedulerAbortedCompletion(f"the scheduler aborted completion {self.index}")
        if len(delta.token_ids) > 1 and self._params.stop and not self._params.is_beam_search:
            return self._apply_per_token(delta)
        new_token_ids = list(delta.token_ids)
        new_logprobs = list(delta.logprobs) if self._params.logprobs > 0 else []
        self.token_ids.extend(new_token_ids)
        self.logprobs.extend(new_logprobs)
        self.cumulative_logprob = delta.cumulative_logprob

        piece = self._detokenizer.add(new_token_ids)
        if delta.finish_reason is not None:
            piece += self._detokenizer.finish()
        update = CompletionUpdate(
            index=self.index, text="", token_ids=new_token_ids, logprobs=new_logprobs,
            cumulative_logprob=self.cumulative_logprob,
        )
        # Stop strings count only once min_tokens tokens exist, like EOS and stop token ids.
        if len(self.token_ids) >= self._params.min_tokens:
            check = self._matcher.feed(piece)
            update.text = check.text
            if check.is_stopped:
                update.finish = CompletionFinish.STOP_SEQUENCE
                update.stop_sequence = check.stop_sequence
                update.is_stopped_by_frontend = delta.finish_reason is None
        else:
            update.text = piece
        if update.finish is None and delta.finish_reason is not None:
            update.text += self._matcher.flush()
            update.finish = _SCHEDULER_FINISH[delta.finish_reason]
        self.text += update.text
        self.finish = update.finish
        self.stop_sequence = update.stop_sequence
        return update

    def _apply_per_token(self, delta: CompletionDelta) -> CompletionUpdate | None:
        """Several tokens of one step (speculative decoding) against stop strings: one token at a
        time, so a stop string ends the completion at the token that completes it, as it would
        without speculation. The cumulative log-probability of a token inside the step is known
        only when logprobs were asked for; otherwise a completion ended there reports the step's."""
        token_ids, logprobs = list(delta.token_ids), list(delta.logprobs)
        cumulative = [delta.cumulative_logprob] * len(token_ids)
        if len(logprobs) == len(token_ids):
            for index in range(len(token_ids) - 2, -1, -1):
                cumulative[index] = cumulative[index + 1] - logprobs[index + 1].logprob
        merged: CompletionUpdate | None = None
        for index, token_id in enumerate(token_ids):
            is_last = index == len(token_ids) - 1
            update = self.apply(CompletionDelta(
                delta.index, [token_id], logprobs[index:index + 1], cumulative[index],
                delta.finish_reason if is_last else None))
            if update is None:
                break
            if merged is None:
                merged = update
            else:
                merged.merge(update)
            if self.is_finished:
                break
        return merged
