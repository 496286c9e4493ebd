"""How a request that did not run to its end is closed: one path for gRPC and HTTP.

Every failure of a public request, before its Generation exists (draining, not ready, invalid) or
while it runs, ends here (through `Admission.failed`); the protocol's edge only maps the returned
RequestError to its own status (gRPC code, OpenAI HTTP error):

```
 why it ended (first that holds)                  RequestError              log line
 the client left too much output unread           BUSY, abort               stream_backlog_exceeded (warning)
 the drain's time ran out and cut it              UNAVAILABLE, error        request_cut_by_drain
   (InFlight.cut)                                   (RequestCut: retry elsewhere)
 cancelled (the client went away, its stream's    CANCELLED, abort          request_cancelled
   write timed out) ... and its deadline passed   TIMEOUT, abort            request_deadline_exceeded
 anything else                                    errors.classify           request_failed (an error with
                                                                              its traceback when INTERNAL)
```

Then, in this order: the Generation is cancelled (its Submit stream closes: the scheduler aborts the
request and frees its blocks; a no-op once the stream has ended), the timer records the end under
the failure's metrics label (once: a later end is ignored), and one log line says why, with the
error's `kind` and the edge's `code` for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from pagedserve.frontend.generation.drain import RequestCut
from pagedserve.frontend.generation.errors import (
    CANCELLED, DEADLINE_PASSED, ErrorKind, RequestError, UndeliveredOutputExceeded, classify,
)

if TYPE_CHECKING:
    from pagedserve.frontend.generation.generation import Generation
    from pagedserve.frontend.metrics import RequestTimer

log = structlog.get_logger()


def _never() -> bool:
    return False


def close_failed(exc: BaseException, timer: RequestTimer, generation: Generation | None = None, *,
                 was_cut: bool = False, deadline_passed: Callable[[], bool] = _never,
                 code_of: Callable[[RequestError], object] = lambda error: error.kind.value,
                 request_id: str = "") -> RequestError:
    """Closes a failed request (see the module docstring) and returns why it failed.

    generation: the request's Generation, None when it failed before one was started;
    was_cut: the drain cut it; deadline_passed: asked once a request was cancelled, whether its
    client's deadline had passed (a protocol without deadlines leaves it); code_of: the edge's
    status for an error, for the log line."""
    event, error = _why(exc, generation, was_cut, deadline_passed)
    if generation is not None:
        generation.cancel()  # aborted in the scheduler, its blocks freed
        request_id = request_id or generation.request.request_id
    timer.on_done(error.metrics_label)
    fields = {"kind": error.kind.value, "code": code_of(error)}
    if request_id:  # else the request id bound to the log context, if any
        fields["request_id"] = request_id
    if event == "stream_backlog_exceeded":
        log.warning(event, max_undelivered=exc.max_undelivered, **fields)
    elif event != "request_failed":
        log.info(event, **fields)
    elif error.is_internal:
        log.error(event, error=error.message, exc_info=exc, **fields)
    else:
        log.info(event, error=error.message, **({"param": error.param} if error.param else {}), **fields)
    return error


def _why(exc: BaseException, generation: Generation | None, was_cut: bool,
         deadline_passed: Callable[[], bool]) -> tuple[str, RequestError]:
    """The log event and the error of a failure (the table of the module docstring)."""
    if isinstance(exc, UndeliveredOutputExceeded):
        return "stream_backlog_exceeded", classify(exc)
    if was_cut:
        return "request_cut_by_drain", classify(RequestCut())
    error = classify(exc)
    if error.kind is ErrorKind.CANCELLED or (generation is not None and generation.is_cancelled):
        if deadline_passed():
            return "request_deadline_exceeded", DEADLINE_PASSED
        return "request_cancelled", CANCELLED
    return "request_failed", error
