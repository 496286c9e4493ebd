"""The scheduler's outputs for one request, turned into the text updates its client is sent.

```
 RequestOutput ──► per-index CompletionState ──► [CompletionUpdate] (the completions that changed,
 (token ids per     detokenize, stop strings        at most one per index, in index order)
  index)                 │ stop string matched
                         └─► on_stopped(index): the scheduler stops that completion, the others go on
```

Beam search completions arrive once, when the request ends, and are released together in index
order (the scheduler ranks beams best first). What the client has of each completion is also
what a resubmission continues from (`continuations()`); beam search starts over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.frontend.generation.completion_state import CompletionState, CompletionUpdate
from pagedserve.frontend.tokenization.detokenizer import Decoder
from pagedserve.frontend.upstream.scheduler_client import SchedulerError
from pagedserve.contracts.request_types import CompletionDelta, Continuation, RequestOutput
from pagedserve.contracts.sampling_params import SamplingParams


class SchedulerProtocolError(SchedulerError):
    """The scheduler's stream broke the internal contract (unknown index, early end)."""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class GenerationUpdate:
    completions: list[CompletionUpdate]  # at most one per index, in index order
    usage: Usage | None = None  # set on the last update only


class UpdateBuilder:
    """The completions of one request as the client has them; `apply()` each scheduler output."""

    def __init__(self, params: SamplingParams, decoder: Decoder, num_prompt_tokens: int,
                 on_stopped: Callable[[int], None]) -> None:
        """on_stopped(index): a stop string ended that completion (the scheduler may go on with it)."""
        self._is_beam_search = params.is_beam_search
        self.states = [CompletionState(i, params, decoder) for i in range(params.num_completions)]
        self._beam_deltas: dict[int, CompletionDelta] = {}
        self._prompt_tokens = num_prompt_tokens
        self._cached_prompt_tokens = 0
        self._on_stopped = on_stopped

    @property
    def is_finished(self) -> bool:
        """Whether every completion has finished."""
        return all(state.is_finished for state in self.states)

    @property
    def unfinished_indices(self) -> list[int]:
        return [state.index for state in self.states if not state.is_finished]

    @property
    def num_tokens(self) -> list[int]:
        """Token ids the client has, per index (for log lines)."""
        return [len(state.token_ids) for state in self.states]

    def apply(self, output: RequestOutput) -> list[CompletionUpdate]:
        """The completions this output changed (raises SchedulerProtocolError for an unknown index)."""
        if output.prompt_tokens:
            self._prompt_tokens = output.prompt_tokens
        self._cached_prompt_tokens = max(self._cached_prompt_tokens, output.cached_prompt_tokens)
        by_index: dict[int, CompletionUpdate] = {}
        for delta in output.deltas:
            self._check_index(delta.index)
            if self._is_beam_search:
                self._beam_deltas[delta.index] = delta  # each carries every token of its beam
                continue
            self._apply_delta(delta, by_index)
        if self._is_beam_search and (output.is_finished or len(self._beam_deltas) == len(self.states)):
            if all(delta.finish_reason is not None for delta in self._beam_deltas.values()):
                for index in sorted(self._beam_deltas):
                    self._apply_delta(self._beam_deltas[index], by_index)
        return [by_index[index] for index in sorted(by_index)]

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self._prompt_tokens,
                     completion_tokens=sum(len(state.token_ids) for state in self.states),
                     cached_prompt_tokens=self._cached_prompt_tokens)

    # -- resubmission ------------------------------------------------------------------------------
    def continuations(self) -> list[Continuation]:
        """What the client has of each completion, for a resubmission: the indices that have tokens
        or have finished (the others start from the prompt). Beam search starts over: none."""
        if self._is_beam_search:
            return []
        return [Continuation(index=state.index, token_ids=list(state.token_ids), is_finished=state.is_finished,
                             cumulative_logprob=state.cumulative_logprob)
                for state in self.states if state.token_ids or state.is_finished]

    def restart(self) -> None:
        """The request is resubmitted: beams collected so far are dropped (they start over)."""
        self._beam_deltas.clear()

    # -- one delta ---------------------------------------------------------------------------------
    def _apply_delta(self, delta: CompletionDelta, by_index: dict[int, CompletionUpdate]) -> None:
        update = self.states[delta.index].apply(delta)
        if update is None or update.is_empty:
            return
        if update.is_stopped_by_frontend:
            self._on_stopped(delta.index)
        if delta.index in by_index:
            by_index[delta.index].merge(update)
        else:
            by_index[delta.index] = update

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self.states):
            raise SchedulerProtocolError(f"the scheduler sent completion index {index} "
                                         f"for a request with {len(self.states)} completions")
