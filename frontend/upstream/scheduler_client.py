"""Client of the scheduler's internal gRPC service (messages converted by scheduler_codec.py).

Transport failures become exceptions the servicer maps to public status codes:

```
 scheduler status / failure             exception              public status
 UNAVAILABLE, connection refused/lost   SchedulerUnavailable   UNAVAILABLE
 a Submit stream broken by the peer     SchedulerLost          UNAVAILABLE, unless resumed
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

DEFAULT_RPC_TIMEOUT_S = 5.0


class SchedulerError(RuntimeError):
    """The scheduler call failed; `code` is the gRPC status it failed with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


class SchedulerUnavailable(SchedulerError):
    """The scheduler cannot be reached, is not ready, or is draining."""


class SchedulerLost(SchedulerUnavailable):
    """A Submit stream broke before its last message, and the frontend did not cancel it: the
    scheduler may have died (or ended the stream itself with UNAVAILABLE)."""


class SchedulerBusy(SchedulerError):
    """The scheduler's waiting queue is full."""


class SchedulerRejected(SchedulerError):
    """The scheduler found the request invalid."""


class SchedulerTimeout(SchedulerError):
    """The call's deadline passed."""


class SubmitCancelled(SchedulerError):
    """The frontend cancelled the Submit stream itself (its own client went away)."""


_ERROR_FOR_CODE = {
    grpc.StatusCode.UNAVAILABLE: SchedulerUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: SchedulerBusy,
    grpc.StatusCode.INVALID_ARGUMENT: SchedulerRejected,
    grpc.StatusCode.DEADLINE_EXCEEDED: SchedulerTimeout,
    grpc.StatusCode.CANCELLED: SubmitCancelled,
}


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The failed call's status code and the message a SchedulerError carries for it."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return code, f"scheduler: {details or code.name}"


def error_from_rpc(exc: grpc.RpcError) -> SchedulerError:
    code, message = _status(exc)
    return _ERROR_FOR_CODE.get(code, SchedulerError)(message, code)


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
            code, message = _status(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise SchedulerLost(message, grpc.StatusCode.UNAVAILABLE) from exc
            raise error_from_rpc(exc) from exc


class SchedulerClient:
    """One channel (with keepalive) to the scheduler, shared by every request of the frontend."""

    def __init__(self, address: str, frontend_id: str = "", channel: grpc.Channel | None = None) -> None:
        self.address = address
        self.frontend_id = frontend_id
        self._channel = channel or with_bearer(grpc.insecure_channel(address, options=INTERNAL_CHANNEL_OPTIONS),
                                               internal_token())
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def submit(self, request: Request, timeout: float | None = None) -> SubmitStream:
        """Starts the request; failures surface while iterating the returned stream."""
        msg = request_to_proto(request, self.frontend_id)
        return SubmitStream(request.request_id, self._stub.Submit(msg, timeout=timeout))

    def finish_completion(self, request_id: str, index: int, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> None:
        self._unary(self._stub.FinishCompletion,
                    scheduler_pb2.FinishCompletionRequest(request_id=request_id, index=index), timeout)

    def get_info(self, timeout: float = DEFAULT_RPC_TIMEOUT_S) -> SchedulerInfo:
        msg = self._unary(self._stub.GetInfo, scheduler_pb2.GetInfoRequest(), timeout)
        return SchedulerInfo(**{f.name: getattr(msg, f.name) for f in fields(SchedulerInfo)})

    @staticmethod
    def _unary(method, msg, timeout: float):
        try:
            return method(msg, timeout=timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
