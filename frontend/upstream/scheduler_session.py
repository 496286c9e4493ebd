"""The frontend's end of a Session stream (scheduler/session.py): many requests on one stream.

```
 SchedulerClient.submit ──► Session.submit: the request's queue registered, a SessionSubmit sent
 reader thread: each SessionResponse ──► every output to its request's queue (one wake-up per step
                                          for the reader, then one per request, as with Submit)
 SessionStream.__iter__: the request's outputs, up to its last one (is_finished), or the error of
                         its status; cancel() sends a cancel (the scheduler aborts the request)
 the stream breaks: every open request fails as its Submit stream would have (SchedulerLost for
                    UNAVAILABLE, or the scheduler gone), and the next submit opens a new Session
```

A SessionStream has SubmitStream's interface and errors (scheduler_client.py), so the rest of the
frontend does not see which of the two carries a request. A request's timeout goes to the
scheduler with it (the Submit deadline's role) and is kept here too: past it, the request is
cancelled and fails with SchedulerTimeout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc

from pagedserve.contracts.request_types import RequestOutput
from pagedserve.contracts.scheduler_codec import output_from_proto
from pagedserve.frontend.upstream.scheduler_errors import (
    SchedulerLost, SchedulerTimeout, SubmitCancelled, error_for_status, error_from_rpc,
)
from pagedserve.internal import scheduler_pb2

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_CANCELLED = object()  # put in a request's queue by cancel()


class SessionStream:
    """The outputs of one request on a Session; `cancel()` (from any thread) aborts it in the scheduler."""

    def __init__(self, request_id: str, session: Session, timeout: float | None) -> None:
        self.request_id = request_id
        self._session = session
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._is_cancelled = threading.Event()
        self._deadline = None if timeout is None else time.monotonic() + timeout

    @property
    def is_cancelled(self) -> bool:
        return self._is_cancelled.is_set()

    def cancel(self) -> None:
        self._is_cancelled.set()
        self._session.cancel(self)
        self._items.put(_CANCELLED)

    def put(self, item) -> None:
        """The reader's: a SessionOutput, or how the Session ended (an RpcError, or None)."""
        self._items.put(item)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            try:
                item = self._items.get(timeout=timeout)
            except queue.Empty:
                self._session.cancel(self)
                raise SchedulerTimeout("scheduler: Deadline Exceeded", grpc.StatusCode.DEADLINE_EXCEEDED) from None
            if item is _CANCELLED or self.is_cancelled:
                raise SubmitCancelled("the Submit stream was cancelled", grpc.StatusCode.CANCELLED)
            if isinstance(item, scheduler_pb2.SessionOutput):
                if item.status_code:
                    code = _CODES.get(item.status_code, grpc.StatusCode.UNKNOWN)
                    raise error_for_status(code, item.status_message, broken=True)
                output = output_from_proto(self.request_id, item.response)
                yield output
                if output.is_finished:
                    return
                continue
            if item is None:  # the scheduler ended the Session with this request open
                raise SchedulerLost("scheduler: the session ended", grpc.StatusCode.UNAVAILABLE)
            raise error_from_rpc(item, broken=True) from item


class Session:
    """One Session call and the requests it carries; ends for good when the call does."""

    def __init__(self, stub) -> None:
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, SessionStream] = {}
        self._lock = threading.Lock()
        self.is_open = True
        self._call = stub.Session(self._requests())
        threading.Thread(target=self._read, name="scheduler-session", daemon=True).start()

    def submit(self, request: scheduler_pb2.SubmitRequest, timeout: float | None) -> SessionStream | None:
        """The request's stream, or None when this Session has ended (the caller opens another)."""
        stream = SessionStream(request.request_id, self, timeout)
        with self._lock:
            if not self.is_open:
                return None
            is_taken = request.request_id in self._streams
            if not is_taken:
                self._streams[request.request_id] = stream
        if is_taken:  # refused here: the scheduler's refusal would end the request that has the id
            stream.put(scheduler_pb2.SessionOutput(
                request_id=request.request_id, status_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                status_message=f"request {request.request_id!r} is already running"))
            return stream
        submit = scheduler_pb2.SessionSubmit(request=request, timeout=timeout or 0.0)
        self._outbox.put(scheduler_pb2.SessionRequest(submit=submit))
        return stream

    def cancel(self, stream: SessionStream) -> None:
        """Aborts the stream's request, if it is still the one open under its id here."""
        with self._lock:
            if self._streams.get(stream.request_id) is not stream or not self.is_open:
                return
            del self._streams[stream.request_id]
        self._outbox.put(scheduler_pb2.SessionRequest(cancel_request_id=stream.request_id))

    def close(self) -> None:
        self._call.cancel()

    def _requests(self):
        while (item := self._outbox.get()) is not None:
            yield item

    def _read(self) -> None:
        end = None
        try:
            for response in self._call:
                for output in response.outputs:
                    with self._lock:
                        stream = self._streams.get(output.request_id)
                        if stream is not None and (output.status_code or output.response.is_finished):
                            del self._streams[output.request_id]
                    if stream is not None:
                        stream.put(output)
        except grpc.RpcError as exc:
            end = exc
        with self._lock:
            self.is_open = False
            streams, self._streams = list(self._streams.values()), {}
        self._outbox.put(None)  # ends the request stream
        for stream in streams:
            stream.put(end)
