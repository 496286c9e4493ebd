"""Runs one validated request against the scheduler and turns its token stream into text updates.

```
 scheduler Submit stream ──► per-index CompletionState ──► GenerationUpdate (one per scheduler output)
   (token ids per index)      detokenize, stop strings        completions that changed; usage on the last
                                   │ stop string matched
                                   └─► FinishCompletion(index) to the scheduler, the other indices go on
```

Beam search completions arrive once, when the request ends, and are released together in index
order (the scheduler ranks beams best first). The run ends when every completion has finished;
if the scheduler has not closed the stream by then (a stop string ended the last completion), the
stream is cancelled, which releases the request in the scheduler.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import structlog

from pagedserve.frontend.completion_state import CompletionState, CompletionUpdate
from pagedserve.frontend.detokenizer import Decoder
from pagedserve.frontend.metrics import RequestTimer
from pagedserve.frontend.scheduler_client import SchedulerClient, SchedulerError, SubmitStream
from pagedserve.frontend.validation import ValidatedRequest
from pagedserve.request_types import CompletionDelta, Request, RequestOutput

log = structlog.get_logger()


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


class Generation:
    """One request in flight. Iterate `run()` in the handler thread; `cancel()` from any thread."""

    def __init__(self, request: ValidatedRequest, client: SchedulerClient, decoder: Decoder,
                 timer: RequestTimer, timeout: float | None = None) -> None:
        self.request = request
        self._client = client
        self._timer = timer
        self._timeout = timeout
        params = request.params
        self._is_beam_search = params.is_beam_search
        self._states = [CompletionState(i, params, decoder) for i in range(params.num_completions)]
        self._beam_deltas: dict[int, CompletionDelta] = {}
        self._prompt_tokens = len(request.prompt_token_ids)
        self._cached_prompt_tokens = 0
        self._stream: SubmitStream | None = None
        self._lock = threading.Lock()
        self._is_cancelled = False

    @property
    def is_cancelled(self) -> bool:
        return self._is_cancelled

    @property
    def states(self) -> list[CompletionState]:
        return self._states

    def cancel(self) -> None:
        """Aborts the request in the scheduler by closing its stream (safe to call at any time)."""
        with self._lock:
            self._is_cancelled = True
            stream = self._stream
        if stream is not None:
            stream.cancel()

    def run(self) -> Iterator[GenerationUpdate]:
        request = Request(request_id=self.request.request_id,
                          prompt_token_ids=self.request.prompt_token_ids, sampling=self.request.params)
        stream = self._client.submit(request, timeout=self._timeout)
        with self._lock:
            self._stream = stream
            if self._is_cancelled:
                stream.cancel()
        is_stream_closed = False
        is_accepted = False
        try:
            for output in stream:
                if not is_accepted:
                    is_accepted = True
                    self._timer.on_accepted(output.prompt_tokens or self._prompt_tokens)
                updates = self._apply(output)
                self._timer.on_tokens(sum(len(update.token_ids) for update in updates))
                is_stream_closed = output.is_finished
                if all(state.is_finished for state in self._states):
                    yield GenerationUpdate(updates, self._usage())
                    return
                if output.is_finished:
                    raise SchedulerProtocolError(
                        "the scheduler finished the request with unfinished completions: "
                        f"{[s.index for s in self._states if not s.is_finished]}")
                if updates:
                    yield GenerationUpdate(updates)
            is_stream_closed = True
            raise SchedulerProtocolError("the scheduler closed the stream before the request finished")
        finally:
            if not is_stream_closed:
                stream.cancel()

    def _apply(self, output: RequestOutput) -> list[CompletionUpdate]:
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
        if self._is_beam_search and (output.is_finished or len(self._beam_deltas) == len(self._states)):
            if all(delta.finish_reason is not None for delta in self._beam_deltas.values()):
                for index in sorted(self._beam_deltas):
                    self._apply_delta(self._beam_deltas[index], by_index)
        return [by_index[index] for index in sorted(by_index)]

    def _apply_delta(self, delta: CompletionDelta, by_index: dict[int, CompletionUpdate]) -> None:
        update = self._states[delta.index].apply(delta)
        if update is None or update.is_empty:
            return
        if update.is_stopped_by_frontend:
            self._finish_in_scheduler(delta.index)
        if delta.index in by_index:
            by_index[delta.index].merge(update)
        else:
            by_index[delta.index] = update

    def _finish_in_scheduler(self, index: int) -> None:
        """A stop string ended one completion: the scheduler stops generating it (best effort;
        tokens it produces meanwhile are dropped, and the request ends with its last completion)."""
        if all(state.is_finished for state in self._states):
            return  # the stream is closed right after, which releases the whole request
        try:
            self._client.finish_completion(self.request.request_id, index)
        except SchedulerError as exc:
            log.warning("finish_completion_failed", index=index, error=str(exc))

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._states):
            raise SchedulerProtocolError(f"the scheduler sent completion index {index} "
                                         f"for a request with {len(self._states)} completions")

    def _usage(self) -> Usage:
        return Usage(prompt_tokens=self._prompt_tokens,
                     completion_tokens=sum(len(state.token_ids) for state in self._states),
                     cached_prompt_tokens=self._cached_prompt_tokens)
