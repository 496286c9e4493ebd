"""Why a request failed, independent of the protocol it came in on.

Both public protocols classify a failure here and only map the kind to their own codes:

```
 exception                                          kind          gRPC status          HTTP
 InvalidParameter, scheduler INVALID_ARGUMENT       INVALID       INVALID_ARGUMENT     400
 SchedulerBusy (waiting queue full),                BUSY          RESOURCE_EXHAUSTED   429
   UndeliveredOutputExceeded (client not reading)
 SchedulerUnavailable (unreachable, not ready,      UNAVAILABLE   UNAVAILABLE          503
   draining), Draining, RequestCut, a completion
   the scheduler aborted on its own
 SchedulerTimeout, the client's deadline passed      TIMEOUT       DEADLINE_EXCEEDED    504
 SubmitCancelled (the client went away)             CANCELLED     CANCELLED            499 (nobody reads it)
 anything else                                      INTERNAL      INTERNAL             500
```

`metrics_label` is the `finish_reason` label of `pagedserve_requests_total` the failure counts under.
A failure already classified travels on as RequestFailed (classify returns its error unchanged).
The path that closes a failed request (which of these it was, the scheduler abort, the timer, the
log line) is failure.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedserve.frontend.generation.completion_state import SchedulerAbortedCompletion
from pagedserve.frontend.generation.drain import Draining, RequestCut
from pagedserve.frontend.upstream.scheduler_client import (
    SchedulerBusy, SchedulerError, SchedulerRejected, SchedulerTimeout, SchedulerUnavailable, SubmitCancelled,
)
from pagedserve.contracts.sampling_params import InvalidParameter


class UndeliveredOutputExceeded(RuntimeError):
    """The client left more output unread than --max-undelivered-messages: the request was aborted."""

    def __init__(self, num_undelivered: int, max_undelivered: int) -> None:
        super().__init__(f"the client left {num_undelivered} messages unread (at most {max_undelivered}, "
                         f"--max-undelivered-messages): the request was aborted")
        self.max_undelivered = max_undelivered


class UnknownAdapterName(Exception):
    """A request names a LoRA adapter the server does not serve."""


class ErrorKind(enum.Enum):
    INVALID = "invalid"
    NOT_FOUND = "not_found"
    BUSY = "busy"
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class RequestError:
    kind: ErrorKind
    message: str
    metrics_label: str  # "rejected", "error" or "abort"
    param: str | None = None  # the offending request field, when one is to blame

    @property
    def is_internal(self) -> bool:
        return self.kind is ErrorKind.INTERNAL


class RequestFailed(Exception):
    """A failure already classified (and recorded), on its way to the protocol's edge."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


CANCELLED = RequestError(ErrorKind.CANCELLED, "the client cancelled the request", "abort")
DEADLINE_PASSED = RequestError(ErrorKind.TIMEOUT, "the deadline passed before the request finished", "abort")


def classify(exc: BaseException) -> RequestError:
    """The kind, message and metrics label of a request's failure."""
    if isinstance(exc, RequestFailed):
        return exc.error
    if isinstance(exc, InvalidParameter):
        return RequestError(ErrorKind.INVALID, str(exc), "rejected", exc.field_name)
    if isinstance(exc, UnknownAdapterName):
        return RequestError(ErrorKind.NOT_FOUND, str(exc), "rejected", "adapter")
    if isinstance(exc, SchedulerRejected):
        return RequestError(ErrorKind.INVALID, str(exc), "rejected")
    if isinstance(exc, SchedulerBusy):
        return RequestError(ErrorKind.BUSY, str(exc), "rejected")
    if isinstance(exc, UndeliveredOutputExceeded):
        return RequestError(ErrorKind.BUSY, str(exc), "abort")
    if isinstance(exc, Draining):
        return RequestError(ErrorKind.UNAVAILABLE, str(exc), "rejected")
    if isinstance(exc, (SchedulerUnavailable, RequestCut)):
        return RequestError(ErrorKind.UNAVAILABLE, str(exc), "error")
    if isinstance(exc, SchedulerAbortedCompletion):
        return RequestError(ErrorKind.UNAVAILABLE, f"{exc} (it may be draining)", "error")
    if isinstance(exc, SchedulerTimeout):
        return DEADLINE_PASSED
    if isinstance(exc, SubmitCancelled):
        return CANCELLED
    if isinstance(exc, SchedulerError):
        return RequestError(ErrorKind.INTERNAL, str(exc), "error")
    return RequestError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", "error")
