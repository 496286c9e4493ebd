"""Client of the scheduler's internal gRPC service (messages converted by scheduler_codec.py).

A scheduler that serves Session (its GetInfo's has_session) gets every request of this client on
one Session stream (scheduler_session.py); one that does not, a Submit stream per request. Both
give the same SubmitStream interface and the same errors (scheduler_errors.py).

Transport failures become exceptions the servicer maps to public status codes:

```
 scheduler status / failure             exception              public status
 UNAVAILABLE, connection refused/lost   SchedulerUnavailable   UNAVAILABLE
 a request stream broken by the peer   SchedulerLost          UNAVAILABLE, unless resumed
   (UNAVAILABLE, or CANCELLED that the    (a SchedulerUnavailable; recovery.py resubmits the
   frontend did not ask for)              request when another scheduler instance is ready)
 RESOURCE_EXHAUSTED (queue full)        SchedulerBusy          RESOURCE_EXHAUSTED
 INVALID_ARGUMENT                       SchedulerRejected      INVALID_ARGUMENT
 DEADLINE_EXCEEDED                      SchedulerTimeout       DEADLINE_EXCEEDED
 CANCELLED (the frontend cancelled)     SubmitCancelled        (the client is gone)
 anything else                          SchedulerError         INTERNAL
```
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields

import grpc

from pagedserve.security.bearer_auth import with_bearer
from pagedserve.security.internal_token import internal_token
from pagedserve.config.grpc_options import INTERNAL_CHANNEL_OPTIONS
from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.contracts.request_types import Request, RequestOutput
from pagedserve.contracts.scheduler_codec import output_from_proto, request_to_proto
from pagedserve.frontend.upstream.scheduler_errors import (  # noqa: F401  (the frontend imports them from here)
    SchedulerBusy, SchedulerError, SchedulerLost, SchedulerRejected, SchedulerTimeout, SchedulerUnavailable,
    SubmitCancelled, error_from_rpc,
)
from pagedserve.frontend.upstream.scheduler_session import Session, SessionStream

DEFAULT_RPC_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class SchedulerInfo:
    is_ready: bool
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_cpu_blocks: int
    tensor_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    instance_id: str  # new at every scheduler start
    has_session: bool = False  # serves Session: this client's requests go on one stream


class SubmitStream:
    """The outputs of one submitted request; `cancel()` (from any thread) aborts it in the scheduler."""

    def __init__(self, request_id: str, call) -> None:
        self.request_id = request_id
        self._call = call
        self._is_cancelled = threading.Event()

    @property
    def is_cancelled(self) -> bool:
        return self._is_cancelled.is_set()

    def cancel(self) -> None:
        self._is_cancelled.set()
        self._call.cancel()

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            for msg in self._call:
                yield output_from_proto(self.request_id, msg)
        except grpc.RpcError as exc:
            if self.is_cancelled:
                raise SubmitCancelled("the Submit stream was cancelled", grpc.StatusCode.CANCELLED) from exc
            raise error_from_rpc(exc, broken=True) from exc


class SchedulerClient:
    """One channel (with keepalive) to the scheduler, shared by every request of the frontend."""

    def __init__(self, address: str, frontend_id: str = "", channel: grpc.Channel | None = None) -> None:
        self.address = address
        self.frontend_id = frontend_id
        self._channel = channel or with_bearer(grpc.insecure_channel(address, options=INTERNAL_CHANNEL_OPTIONS),
                                               internal_token())
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._has_session = False  # the last GetInfo's has_session
        self._session: Session | None = None
        self._session_lock = threading.Lock()

    def close(self) -> None:
        with self._session_lock:
            session, self._session = self._session, None
        if session is not None:
            session.close()
        self._channel.close()

    def submit(self, request: Request, timeout: float | None = None) -> SubmitStream | SessionStream:
        """Starts the request; failures surface while iterating the returned stream."""
        msg = request_to_proto(request, self.frontend_id)
        if not self._has_session:
            return SubmitStream(request.request_id, self._stub.Submit(msg, timeout=timeout))
        with self._session_lock:
            while True:
                if self._session is None or not self._session.is_open:
                    self._session = Session(self._stub)
                stream = self._session.submit(msg, timeout)
                if stream is not None:
                    return stream

    def finish_completion(self, request_id: str, index: int, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> None:
        self._unary(self._stub.FinishCompletion,
                    scheduler_pb2.FinishCompletionRequest(request_id=request_id, index=index), timeout)

    def get_info(self, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> SchedulerInfo:
        msg = self._unary(self._stub.GetInfo, scheduler_pb2.GetInfoRequest(), timeout)
        self._has_session = msg.has_session
        return SchedulerInfo(**{f.name: getattr(msg, f.name) for f in fields(SchedulerInfo)})

    @staticmethod
    def _unary(method, msg, timeout: float):
        try:
            return method(msg, timeout=timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
