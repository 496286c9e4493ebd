"""Runs one validated request against the scheduler: one Submit stream after another until every
completion has finished, or the request fails.

```
 run() ──► place on a replica (several replicas: upstream/rerouting.py)
   └─► Submit stream ──► UpdateBuilder (updates.py) ──► GenerationUpdate per scheduler output
          │ refused (UNAVAILABLE, RESOURCE_EXHAUSTED) before output, or lost mid-stream:
          │   another replica (rerouting.py), else
          │ lost: wait for a new scheduler (recovery.py), resubmit as a continuation
          │ refused while resuming (full queue): wait for room (recovery.py), resubmit
          └─ anything else: raised to the protocol's edge (failure.py closes the request)
```

The run ends when every completion has finished; if the scheduler has not closed the stream by
then (a stop string ended the last completion), the stream is cancelled, which releases the
request in the scheduler. `cancel()` closes the stream at any time (the scheduler aborts the
request and frees its blocks).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import structlog

from pagedserve.frontend.generation.completion_state import CompletionState
from pagedserve.frontend.generation.recovery import Recovery, SchedulerRecovery
from pagedserve.frontend.generation.updates import GenerationUpdate, SchedulerProtocolError, UpdateBuilder
from pagedserve.frontend.tokenization.detokenizer import Decoder
from pagedserve.frontend.metrics import RequestTimer
from pagedserve.frontend.upstream.rerouting import Rerouting
from pagedserve.frontend.upstream.scheduler_client import (
    SchedulerBusy, SchedulerClient, SchedulerError, SchedulerLost, SchedulerUnavailable, SubmitStream,
)
from pagedserve.frontend.grpc.validation import ValidatedRequest
from pagedserve.contracts.request_types import Continuation, Request

if TYPE_CHECKING:
    from pagedserve.frontend.upstream.replica_set import Replica, ReplicaSet

log = structlog.get_logger()


class Generation:
    """One request in flight. Iterate `run()` in the handler thread; `cancel()` from any thread."""

    def __init__(self, request: ValidatedRequest, client: SchedulerClient, decoder: Decoder,
                 timer: RequestTimer, timeout: float | None = None, *,
                 recovery: SchedulerRecovery | None = None, instance_id: str = "",
                 replicas: ReplicaSet | None = None, whole: bool = False) -> None:
        """instance_id: the scheduler instance the request goes to (readiness's latest answer).
        replicas: several replicas; the request is placed on one when it runs (client and
        instance_id then come from that replica). whole: the client takes the result at the end
        (no stream); without stop strings, which the frontend must see each token to find, the
        scheduler then holds the outputs after the first and sends them merged (hold_output)."""
        self.request = request
        self.holds_output = whole and not request.params.stop and not request.params.is_beam_search
        self._client = client
        self._timer = timer
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._instance_id = instance_id
        self.num_resumes = 0
        self._updates = UpdateBuilder(request.params, decoder, len(request.prompt_token_ids),
                                      on_stopped=self._finish_in_scheduler)
        self._stream: SubmitStream | None = None
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._recovery = Recovery(recovery, self._cancelled)
        self._is_accepted = False
        self._has_output_since_submit = False
        self._rerouting = Rerouting(replicas, request.prompt_token_ids) if replicas is not None else None
        self.replica_address = ""  # several replicas: the scheduler address it ran on (last)

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def states(self) -> list[CompletionState]:
        return self._updates.states

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
            if self._rerouting is not None:
                self._go_to(self._rerouting.place())
            while True:
                try:
                    yield from self._run_once()
                    return
                except SchedulerLost as lost:
                    if self._reroute(lost):
                        continue
                    self._await_new_scheduler(lost, broke_at=time.monotonic())
                except (SchedulerBusy, SchedulerUnavailable) as refused:
                    if self._reroute(refused):
                        continue
                    if isinstance(refused, SchedulerUnavailable) or not self.num_resumes \
                            or self._has_output_since_submit:
                        raise
                    self._recovery.await_queue_room()
        finally:
            if self._rerouting is not None:
                self._rerouting.release()

    def continuations(self) -> list[Continuation]:
        """What the client has of each completion, for a resubmission (UpdateBuilder.continuations)."""
        return self._updates.continuations()

    # -- one Submit stream ------------------------------------------------------------------------
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
                self._recovery.on_output()
                if not self._is_accepted:
                    self._is_accepted = True
                    self._timer.on_accepted(output.prompt_tokens or len(self.request.prompt_token_ids))
                updates = self._updates.apply(output)
                self._timer.on_tokens(sum(len(update.token_ids) for update in updates),
                                      is_merged=self.holds_output)
                is_stream_closed = output.is_finished
                if self._updates.is_finished:
                    yield GenerationUpdate(updates, self._updates.usage())
                    return
                if output.is_finished:
                    raise SchedulerProtocolError(
                        "the scheduler finished the request with unfinished completions: "
                        f"{self._updates.unfinished_indices}")
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
                          priority=self.request.priority, adapter=self.request.adapter,
                          hold_output=self.holds_output)
        if self.num_resumes:
            request.continuations = self.continuations()
        return request

    def _finish_in_scheduler(self, index: int) -> None:
        """A stop string ended one completion: the scheduler stops generating it (best effort;
        tokens it produces meanwhile are dropped, and the request ends with its last completion)."""
        if self._updates.is_finished:
            return  # the stream is closed right after, which releases the whole request
        try:
            self._client.finish_completion(self.request.request_id, index)
        except SchedulerError as exc:
            log.warning("finish_completion_failed", index=index, error=str(exc))

    def _time_left(self) -> float | None:
        """Seconds to the client's deadline (None: no deadline)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    # -- going on elsewhere -----------------------------------------------------------------------
    def _await_new_scheduler(self, lost: SchedulerLost, broke_at: float) -> None:
        info = self._recovery.await_new_scheduler(lost, broke_at, self._instance_id, self._time_left(),
                                                  num_resumes=self.num_resumes, num_tokens=self._updates.num_tokens)
        self._instance_id = info.instance_id
        self._resubmitting()
        log.info("request_resuming", num_resumes=self.num_resumes, seconds_lost=round(time.monotonic() - broke_at, 3),
                 num_tokens=self._updates.num_tokens, starts_over=self.request.params.is_beam_search)

    def _reroute(self, error: SchedulerError) -> bool:
        """With several replicas: the request goes on on another one (Rerouting.move); False when
        it does not."""
        if self._rerouting is None or self._rerouting.replica is None or self._cancelled.is_set():
            return False
        gone = self._rerouting.replica.index
        replica = self._rerouting.move(error, has_output_since_submit=self._has_output_since_submit,
                                       is_accepted=self._is_accepted, can_resume=self._recovery.is_on)
        if replica is None:
            return False
        self._go_to(replica)
        if self._is_accepted:
            self._resubmitting()
        log.warning("request_rerouted", error=str(error), from_replica=gone, to_replica=replica.index,
                    num_resumes=self.num_resumes, num_tokens=self._updates.num_tokens)
        return True

    def _go_to(self, replica: Replica) -> None:
        """The request's next Submit goes to this replica's scheduler."""
        self.replica_address = replica.address
        self._client = replica.client
        info = replica.readiness.info
        self._instance_id = info.instance_id if info is not None else ""
        self._recovery.watch(replica.readiness)

    def _resubmitting(self) -> None:
        self.num_resumes += 1
        self._updates.restart()
