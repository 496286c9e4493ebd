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

A scheduler that dies takes the request with it, but the frontend holds what is needed to go on:
per index, the token ids the client has and whether that completion ended. When the stream breaks
(SchedulerLost) the request is resubmitted as a continuation, so the client's stream goes on
without a gap or a repeated token:

```
 stream breaks ──► same scheduler instance answers GetInfo? ── yes: it ended the stream itself:
 (UNAVAILABLE,           │ no (unreachable, or restarted)        fail with its UNAVAILABLE
  CANCELLED by peer)     ▼
                  wait for a ready scheduler of another instance (--scheduler-recovery-timeout)
                         │ none in time: UNAVAILABLE            │ ready
                         ▼                                      ▼
                  resubmit: prompt + Continuation per index (generated token ids, finished?)
                  beam search: the bare request again (nothing was streamed yet)
```

Logprobs of tokens already streamed are not recomputed; usage keeps the original prompt's count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc
import structlog

from pagedserve.frontend.generation.completion_state import CompletionState, CompletionUpdate
from pagedserve.frontend.tokenization.detokenizer import Decoder
from pagedserve.frontend.metrics import RequestTimer
from pagedserve.frontend.upstream.readiness import ReadinessMonitor
from pagedserve.frontend.upstream.scheduler_client import (
    SchedulerBusy, SchedulerClient, SchedulerError, SchedulerLost, SchedulerUnavailable, SubmitCancelled,
    SubmitStream,
)
from pagedserve.frontend.grpc.validation import ValidatedRequest
from pagedserve.contracts.request_types import CompletionDelta, Continuation, Request, RequestOutput

if TYPE_CHECKING:
    from pagedserve.frontend.upstream.replica_set import Replica, ReplicaSet

log = structlog.get_logger()
BUSY_RETRY_S = 0.5  # a resubmission the new scheduler's full queue refused is tried again after this


class SchedulerProtocolError(SchedulerError):
    """The scheduler's stream broke the internal contract (unknown index, early end)."""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class SchedulerRecovery:
    """How a request rides out the loss of its scheduler: `readiness` tells a restarted scheduler
    from the one that ran the request; `timeout_s` bounds each wait (0: no recovery)."""

    readiness: ReadinessMonitor
    timeout_s: float


@dataclass(slots=True)
class GenerationUpdate:
    completions: list[CompletionUpdate]  # at most one per index, in index order
    usage: Usage | None = None  # set on the last update only


class Generation:
    """One request in flight. Iterate `run()` in the handler thread; `cancel()` from any thread."""

    def __init__(self, request: ValidatedRequest, client: SchedulerClient, decoder: Decoder,
                 timer: RequestTimer, timeout: float | None = None, *,
                 recovery: SchedulerRecovery | None = None, instance_id: str = "",
                 replicas: ReplicaSet | None = None) -> None:
        """instance_id: the scheduler instance the request goes to (readiness's latest answer).
        replicas: several replicas; the request is placed on one when it runs (client and
        instance_id then come from that replica)."""
        self.request = request
        self._client = client
        self._timer = timer
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._recovery = recovery
        self._instance_id = instance_id
        self.num_resumes = 0
        params = request.params
        self._is_beam_search = params.is_beam_search
        self._states = [CompletionState(i, params, decoder) for i in range(params.num_completions)]
        self._beam_deltas: dict[int, CompletionDelta] = {}
        self._prompt_tokens = len(request.prompt_token_ids)
        self._cached_prompt_tokens = 0
        self._stream: SubmitStream | None = None
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._is_accepted = False
        self._has_output_since_submit = False
        self._busy_since: float | None = None  # a resubmission refused for a full queue since then
        self._replicas = replicas
        self._replica: Replica | None = None
        self._tried_replicas: set[int] = set()  # refused this request before its first token
        self.replica_address = ""  # several replicas: the scheduler address it ran on (last)

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def states(self) -> list[CompletionState]:
        return self._states

    def cancel(self) -> None:
        """Aborts the request in the scheduler by closing its stream (safe to call at any time)."""
        with self._lock:
            self._cancelled.set()
            stream = self._stream
        if stream is not None:
            stream.cancel()

    def run(self) -> Iterator[GenerationUpdate]:
        """Updates until every completion has finished; resubmits the request as a continuation
        when its scheduler is lost and another one is ready in time."""
        try:
            if self._replicas is not None:
                self._place()
            while True:
                try:
                    yield from self._run_once()
                    return
                except SchedulerLost as lost:
                    if self._move_to_another_replica(lost):
                        continue
                    self._await_new_scheduler(lost, broke_at=time.monotonic())
                except (SchedulerBusy, SchedulerUnavailable) as refused:
                    if self._move_to_another_replica(refused):
                        continue
                    if isinstance(refused, SchedulerUnavailable) or not self.num_resumes \
                            or self._has_output_since_submit:
                        raise
                    self._await_queue_room()
        finally:
            if self._replica is not None:
                self._replicas.release(self._replica)
                self._replica = None

    # -- several replicas -------------------------------------------------------------------------
    def _place(self, exclude: frozenset[int] = frozenset()) -> bool:
        """Puts the request on a ready replica (not in exclude); False when none is left."""
        replica = self._replicas.place(self.request.prompt_token_ids, exclude)
        if replica is None:
            if self._replica is None:
                raise SchedulerUnavailable(f"no scheduler replica is ready ({self._replicas.address})")
            return False
        if self._replica is not None:
            self._replicas.release(self._replica)
        self._replica = replica
        self.replica_address = replica.address
        self._client = replica.client
        info = replica.readiness.info
        self._instance_id = info.instance_id if info is not None else ""
        if self._recovery is not None:
            self._recovery = replace(self._recovery, readiness=replica.readiness)
        return True

    def _move_to_another_replica(self, error: SchedulerError) -> bool:
        """With several replicas: a request refused before its first output (UNAVAILABLE,
        RESOURCE_EXHAUSTED), or whose replica was lost mid-stream, goes to another ready replica
        (a continuation when tokens were streamed). False when there is none, or when the
        refusal came after output (then the single-scheduler handling applies)."""
        if self._replica is None or self._cancelled.is_set():
            return False
        is_lost = isinstance(error, SchedulerLost)
        if not is_lost and self._has_output_since_submit:
            return False
        if is_lost and self._is_accepted and (self._recovery is None or self._recovery.timeout_s <= 0):
            return False  # resuming tokens already streamed is recovery, which is off
        self._tried_replicas.add(self._replica.index)
        gone = self._replica.index
        if not self._place(frozenset(self._tried_replicas)):
            return False
        if self._is_accepted:
            self.num_resumes += 1
            self._beam_deltas.clear()
        log.warning("request_rerouted", error=str(error), from_replica=gone, to_replica=self._replica.index,
                    num_resumes=self.num_resumes, num_tokens=[len(state.token_ids) for state in self._states])
        return True

    def _run_once(self) -> Iterator[GenerationUpdate]:
        """One Submit stream: a fresh request, or the continuation of one whose scheduler was lost."""
        stream = self._client.submit(self._scheduler_request(), timeout=self._time_left())
        with self._lock:
            self._stream = stream
            if self._cancelled.is_set():
                stream.cancel()
        self._has_output_since_submit = False
        is_stream_closed = False
        try:
            for output in stream:
                self._has_output_since_submit = True
                self._busy_since = None
                if not self._is_accepted:
                    self._is_accepted = True
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

    def _scheduler_request(self) -> Request:
        request = Request(request_id=self.request.request_id,
                          prompt_token_ids=self.request.prompt_token_ids, sampling=self.request.params,
                          priority=self.request.priority, adapter=self.request.adapter)
        if self.num_resumes:
            request.continuations = self.continuations()
        return request

    def continuations(self) -> list[Continuation]:
        """What the client has of each completion, for a resubmission: the indices that have tokens
        or have finished (the others start from the prompt). Beam search starts over: none."""
        if self._is_beam_search:
            return []
        return [Continuation(index=state.index, token_ids=list(state.token_ids), is_finished=state.is_finished,
                             cumulative_logprob=state.cumulative_logprob)
                for state in self._states if state.token_ids or state.is_finished]

    def _await_new_scheduler(self, lost: SchedulerLost, broke_at: float) -> None:
        """Returns once another scheduler instance is ready to take the continuation; raises when
        the stream ended for good (the scheduler that ran it is alive, no recovery, time's up)."""
        recovery = self._recovery
        if recovery is None or recovery.timeout_s <= 0 or self._cancelled.is_set():
            raise lost
        answer = recovery.readiness.answer_after(broke_at)
        if answer is not None and answer.instance_id == self._instance_id:
            raise lost  # the scheduler that ran it is up: it ended the stream itself
        log.warning("scheduler_lost", error=str(lost), num_resumes=self.num_resumes,
                    num_tokens=[len(state.token_ids) for state in self._states],
                    recovery_timeout=recovery.timeout_s)
        timeout = recovery.timeout_s
        time_left = self._time_left()
        info = recovery.readiness.wait_for_new_scheduler(
            self._instance_id, timeout if time_left is None else min(timeout, time_left), self._cancelled.is_set)
        if self._cancelled.is_set():
            raise SubmitCancelled("cancelled while waiting for the scheduler to come back", grpc.StatusCode.CANCELLED)
        if info is None:
            raise SchedulerUnavailable(f"the scheduler was lost and none was ready again within "
                                       f"{timeout:g}s (--scheduler-recovery-timeout); {lost}")
        self._instance_id = info.instance_id
        self.num_resumes += 1
        self._beam_deltas.clear()
        log.info("request_resuming", num_resumes=self.num_resumes, seconds_lost=round(time.monotonic() - broke_at, 3),
                 num_tokens=[len(state.token_ids) for state in self._states],
                 starts_over=self._is_beam_search)

    def _await_queue_room(self) -> None:
        """Every frontend resubmits at once: a continuation the new scheduler's full queue refused
        is tried again every BUSY_RETRY_S, for up to the recovery timeout from the first refusal."""
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
        if now - self._busy_since + BUSY_RETRY_S > self._recovery.timeout_s:
            raise SchedulerBusy("the restarted scheduler's queue stayed full: the request could not be resumed",
                                grpc.StatusCode.RESOURCE_EXHAUSTED)
        if self._cancelled.wait(BUSY_RETRY_S):
            raise SubmitCancelled("cancelled while waiting for room in the scheduler's queue",
                                  grpc.StatusCode.CANCELLED)

    def _time_left(self) -> float | None:
        """Seconds to the client's deadline (None: no deadline)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

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
