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
 SchedulerTimeout                                   TIMEOUT       DEADLINE_EXCEEDED    504
 anything else                                      INTERNAL      INTERNAL             500
```

`metrics_label` is the `finish_reason` label of `pagedserve_requests_total` the failure counts under.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedserve.frontend.generation.completion_state import SchedulerAbortedCompletion
from pagedserve.frontend.generation.drain import Draining, RequestCut
from pagedserve.frontend.upstream.scheduler_client import (
    SchedulerBusy, SchedulerError, SchedulerRejected, SchedulerTimeout, SchedulerUnavailable,
)
from pagedserve.contracts.sampling_params import InvalidParameter


class UndeliveredOutputExceeded(RuntimeError):
    """The client left more output unread than --max-undelivered-messages: the request was aborted."""


class ErrorKind(enum.Enum):
    INVALID = "invalid"
    BUSY = "busy"
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
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


def classify(exc: BaseException) -> RequestError:
    """The kind, message and metrics label of a request's failure."""
    if isinstance(exc, InvalidParameter):
        return RequestError(ErrorKind.INVALID, str(exc), "rejected", exc.field_name)
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
        return RequestError(ErrorKind.TIMEOUT, "the deadline passed before the request finished", "abort")
    if isinstance(exc, SchedulerError):
        return RequestError(ErrorKind.INTERNAL, str(exc), "error")
    return RequestError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", "error")
