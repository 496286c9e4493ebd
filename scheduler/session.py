"""One frontend's requests on one stream: the internal Session RPC (server.py serves it).

A Submit stream per request costs the scheduler one gRPC message per request per step, and the
frontend a thread wake-up for each; on a Session the outputs of a step for all of a frontend's
requests go out in one message:

    frontend ──SessionRequest──▶ reader ── submit: checks, grammar, engine.submit
                                       └── cancel: engine.abort
    engine (per step) ──▶ each request's UndeliveredOutput ──on_ready──▶ writer: what every request
                          has queued, in one SessionResponse ──▶ frontend

Each request keeps the Submit stream's contract (server.py): the same checks, refusals and status
codes (sent as its SessionOutput's status); a cancel, its timeout (Submit's deadline) or the end of
the Session aborts it in the engine and frees its blocks; past max_undelivered_bytes of unread
output it is aborted and ends with RESOURCE_EXHAUSTED (the writer takes a request's outputs only
when it can send them, so they wait in its UndeliveredOutput); the same log lines. A frontend that
half-closes its side gets the outputs of the requests it has open, then the end of the stream.
Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pagedserve.contracts.scheduler_codec import request_from_proto
from pagedserve.internal import scheduler_pb2
from pagedserve.scheduler.undelivered_output import Delivery, OutputOverflow, UndeliveredOutput

# A Session message carries up to this many bytes of outputs (at least one output, whatever its size):
# the outputs a frontend left unread, up to --max-undelivered-bytes for each of its requests, would
# not fit in one message
MESSAGE_BYTES = 4 << 20
# The frontend cancels a request when its client's deadline passes, a little before this end's copy
# of the same deadline: a request closed this close to its deadline timed out (Submit and Session).
DEADLINE_SLACK_S = 0.25


@dataclass(slots=True)
class _OpenRequest:
    request_id: str
    log: object
    outputs: UndeliveredOutput | None = None
    is_submitted: bool = False  # handed to the engine (an abort must reach it)
    is_started: bool = False  # an output was sent
    is_cancelled: bool = False
    deadline: float | None = None  # loop time
    timer: asyncio.TimerHandle | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)
    num_messages: int = 0


class SessionStream:
    """One Session call: `responses()` is its response stream."""

    def __init__(self, servicer, request_iterator, context) -> None:
        self._servicer = servicer
        self._requests = request_iterator
        self._context = context
        self._loop = asyncio.get_running_loop()
        self._open: dict[str, _OpenRequest] = {}
        self._ready: dict[str, None] = {}  # requests with outputs queued, in the order they got them
        self._wake = asyncio.Event()
        self._is_reading = True
        self._pending_status: list[scheduler_pb2.SessionOutput] = []  # ends of requests the engine never had
        self._log = servicer.log
        self._num_requests = 0  # submitted to the engine
        self._compiling: set[asyncio.Future] = set()  # submits waiting for their grammar
        self._is_closing = False  # close(): the stream ends once what is open has ended

    async def responses(self):
        reader = asyncio.ensure_future(self._read())
        # read once, now: the context's peer() after a cancelled call ends crashes grpc.aio (segfault)
        peer = self._context.peer()
        self._log.info("session_opened", peer=peer)
        try:
            while (self._is_reading and not self._is_closing) or self._open or self._ready or self._pending_status:
                await self._wake.wait()
                self._wake.clear()
                response = self._take()
                if response.outputs:
                    yield response
            if not self._is_closing:
                await reader  # a failure of the reader surfaces here
        finally:
            reader.cancel()
            for task in self._compiling:
                task.cancel()
            num_open = len(self._open)
            for request_id in list(self._open):
                self._abort(request_id)
            self._log.info("session_closed", peer=peer, num_requests=self._num_requests,
                           num_aborted=num_open)

    def close(self) -> None:
        """Ends the stream once every request on it has ended (the scheduler stops: its engine has
        ended them all), with an OK status, instead of the server cancelling the call."""
        self._is_closing = True
        self._wake.set()

    # -- frontend -> scheduler ----------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            async for message in self._requests:
                kind = message.WhichOneof("kind")
                if kind == "submit":
                    self._submit(message.submit)
                elif kind == "cancel_request_id":
                    self._abort(message.cancel_request_id)
        finally:
            self._is_reading = False
            self._wake.set()

    def _submit(self, submit: scheduler_pb2.SessionSubmit) -> None:
        """Registers the request before anything awaits (a cancel that follows finds it), checks it,
        and hands it to the engine: at once, or after its grammar is compiled (a task, so the
        requests behind it on the stream do not wait)."""
        servicer, request = self._servicer, submit.request
        log = self._log.bind(request_id=request.request_id, frontend_id=request.frontend_id)
        if request.request_id in self._open:
            self._refused(request.request_id, log, grpc.StatusCode.INVALID_ARGUMENT,
                          f"request {request.request_id!r} is already running on this session")
            return
        entry = self._open[request.request_id] = _OpenRequest(request.request_id, log)
        if submit.timeout > 0:
            entry.deadline = self._loop.time() + submit.timeout
            entry.timer = self._loop.call_at(entry.deadline, self._expire, entry)
        if servicer.is_draining:
            servicer.metrics.requests_rejected.labels(reason="draining").inc()
            log.info("request_rejected", code="UNAVAILABLE", error="draining")
            self._end(entry, grpc.StatusCode.UNAVAILABLE, "the scheduler is draining; retry on another replica")
            return
        try:
            internal = request_from_proto(request, servicer.model.eos_token_ids)
            # beam search sends its completions once, whole, at the end: nothing to merge
            entry.outputs = UndeliveredOutput(servicer.max_undelivered_bytes, lambda: self._overflowed(entry),
                                              hold=internal.hold_output and not internal.sampling.is_beam_search,
                                              on_ready=lambda: self._mark_ready(entry.request_id))
            servicer.check_submitted(internal)
        except Exception as exc:
            self._end(entry, servicer.rejected(log, exc), str(exc))
            return
        constraint = internal.sampling.constraint
        if constraint is not None and servicer.grammars is not None:
            task = asyncio.ensure_future(self._start_compiled(entry, internal, constraint))
            self._compiling.add(task)
            task.add_done_callback(self._compiling.discard)
        else:
            self._start(entry, internal)

    async def _start_compiled(self, entry: _OpenRequest, internal, constraint) -> None:
        try:
            await self._servicer.grammars.compile_async(constraint)  # off the step loop, bounded in time
        except Exception as exc:
            if not entry.is_cancelled:
                self._end(entry, self._servicer.rejected(entry.log, exc), str(exc))
            return
        self._start(entry, internal)

    def _start(self, entry: _OpenRequest, internal) -> None:
        if entry.is_cancelled:
            return
        servicer = self._servicer
        try:
            servicer.engine.submit(internal, entry.outputs.put)  # on this event loop (see loop_dispatch)
        except Exception as exc:
            self._end(entry, servicer.rejected(entry.log, exc), str(exc))
            return
        entry.is_submitted = True
        servicer.num_open_streams += 1
        self._num_requests += 1
        entry.log.info("request_submitted", prompt_tokens=len(internal.prompt_token_ids),
                       max_tokens=internal.sampling.max_tokens, num_completions=internal.sampling.num_completions,
                       via="session", **servicer.continued(internal))

    def _refused(self, request_id: str, log, code: grpc.StatusCode, message: str) -> None:
        """A submit refused before it was registered (its id is taken): the status goes out alone."""
        self._servicer.metrics.requests_rejected.labels(reason="invalid").inc()
        log.info("request_rejected", code=code.name, error=message)
        self._pending_status.append(scheduler_pb2.SessionOutput(request_id=request_id, status_code=code.value[0],
                                                                status_message=message))
        self._wake.set()

    # -- scheduler -> frontend ----------------------------------------------------------------------
    def _mark_ready(self, request_id: str) -> None:
        self._ready[request_id] = None
        self._wake.set()

    def _take(self) -> scheduler_pb2.SessionResponse:
        """One message: what the requests have queued, up to MESSAGE_BYTES (the rest goes next)."""
        response = scheduler_pb2.SessionResponse(outputs=self._pending_status)
        self._pending_status.clear()
        ready, self._ready = self._ready, {}
        budget = MESSAGE_BYTES
        for request_id in ready:
            entry = self._open.get(request_id)
            if entry is None or entry.outputs is None:
                continue
            if budget <= 0:
                self._ready[request_id] = None
                continue
            items, num_bytes = entry.outputs.take_ready(budget)
            budget -= num_bytes
            for item in items:
                if isinstance(item, Delivery):
                    self._deliver(response, entry, item)
                else:
                    self._fail(response, entry, item)
                if request_id not in self._open:
                    break
            if request_id in self._open and entry.outputs.has_ready:
                self._ready[request_id] = None
        if self._ready:
            self._wake.set()
        return response

    def _deliver(self, response, entry: _OpenRequest, item: Delivery) -> None:
        entry.is_started = True
        entry.num_messages += 1
        for delta in item.output.deltas:
            if delta.finish_reason is not None:
                entry.finish_reasons[delta.index] = delta.finish_reason.value
        response.outputs.add(request_id=entry.request_id, response=item.message)
        if item.output.is_finished:
            entry.log.info("request_finished",
                           finish_reasons=[entry.finish_reasons[i] for i in sorted(entry.finish_reasons)],
                           num_messages=entry.num_messages)
            self._close(entry)

    def _fail(self, response, entry: _OpenRequest, error: Exception) -> None:
        if not entry.is_started and not isinstance(error, OutputOverflow):  # refused, or no workers
            code = self._servicer.rejected(entry.log, error)
        else:  # as a Submit stream logs it
            code = self._servicer.status_for(error)
            entry.log.warning("request_failed", error=str(error))
        response.outputs.add(request_id=entry.request_id, status_code=code.value[0], status_message=str(error))
        self._close(entry)

    def _end(self, entry: _OpenRequest, code: grpc.StatusCode, message: str) -> None:
        """Ends a request that never reached the engine with `code`."""
        self._close(entry)
        self._pending_status.append(scheduler_pb2.SessionOutput(request_id=entry.request_id,
                                                                status_code=code.value[0], status_message=message))
        self._wake.set()

    # -- ends -----------------------------------------------------------------------------------------
    def _overflowed(self, entry: _OpenRequest) -> None:
        self._servicer.engine.abort(entry.request_id)
        entry.log.warning("request_aborted", reason="undelivered_output_cap",
                          max_bytes=self._servicer.max_undelivered_bytes)

    def _expire(self, entry: _OpenRequest) -> None:
        """The request's timeout passed before the frontend cancelled it: aborted, DEADLINE_EXCEEDED."""
        if entry.request_id not in self._open:
            return
        self._abort(entry.request_id)
        self._pending_status.append(scheduler_pb2.SessionOutput(
            request_id=entry.request_id, status_code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
            status_message="the request's timeout passed"))
        self._wake.set()

    def _abort(self, request_id: str) -> None:
        """A cancel, a passed timeout or the end of the session: the request is aborted, silently."""
        entry = self._open.get(request_id)
        if entry is None:
            return
        entry.is_cancelled = True
        if entry.is_submitted:
            self._servicer.engine.abort(request_id)
            remaining = None if entry.deadline is None else entry.deadline - self._loop.time()
            reason = "deadline_exceeded" if remaining is not None and remaining <= DEADLINE_SLACK_S else "stream_closed"
            entry.log.info("request_aborted", reason=reason)
        self._close(entry)

    def _close(self, entry: _OpenRequest) -> None:
        if self._open.pop(entry.request_id, None) is None:
            return
        if entry.timer is not None:
            entry.timer.cancel()
        if entry.is_submitted:
            self._servicer.num_open_streams -= 1
        self._wake.set()  # the writer's loop may be waiting for the last request to end
