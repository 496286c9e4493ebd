"""What a failed call to the scheduler raises in the frontend (scheduler_client.py's table), for
a Submit stream and a Session (scheduler_session.py) alike."""

from __future__ import annotations

import grpc


class SchedulerError(RuntimeError):
    """The scheduler call failed; `code` is the gRPC status it failed with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


class SchedulerUnavailable(SchedulerError):
    """The scheduler cannot be reached, is not ready, or is draining."""


class SchedulerLost(SchedulerUnavailable):
    """A request's stream (its Submit, or its part of a Session) broke before its last message, and
    the frontend did not cancel it: the scheduler may have died (or ended it with UNAVAILABLE)."""


class SchedulerBusy(SchedulerError):
    """The scheduler's waiting queue is full."""


class SchedulerRejected(SchedulerError):
    """The scheduler found the request invalid."""


class SchedulerTimeout(SchedulerError):
    """The call's deadline passed."""


class SubmitCancelled(SchedulerError):
    """The frontend cancelled the request's stream itself (its own client went away)."""


_ERROR_FOR_CODE = {
    grpc.StatusCode.UNAVAILABLE: SchedulerUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: SchedulerBusy,
    grpc.StatusCode.INVALID_ARGUMENT: SchedulerRejected,
    grpc.StatusCode.DEADLINE_EXCEEDED: SchedulerTimeout,
    grpc.StatusCode.CANCELLED: SubmitCancelled,
}


def error_for_status(code: grpc.StatusCode, details: str, *, broken: bool = False) -> SchedulerError:
    """The error of a call that ended with `code`. broken: a request's stream that ended before its
    last output, which the frontend did not cancel: UNAVAILABLE and CANCELLED then mean the scheduler
    may be gone (SchedulerLost)."""
    message = f"scheduler: {details or code.name}"
    if broken and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return SchedulerLost(message, grpc.StatusCode.UNAVAILABLE)
    return _ERROR_FOR_CODE.get(code, SchedulerError)(message, code)


def error_from_rpc(exc: grpc.RpcError, *, broken: bool = False) -> SchedulerError:
    """The error of a failed call (`broken`: as error_for_status)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_for_status(code, details, broken=broken)
