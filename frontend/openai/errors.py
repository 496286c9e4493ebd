"""Failures of the OpenAI-compatible HTTP API as OpenAI reports them:
`{"error": {"message", "type", "param", "code"}}` with the HTTP status.

```
 status  type                    when
 400     invalid_request_error   any validation failure (param names the field): bad JSON, wrong
                                 types, a body over --max-request-bytes, not UTF-8, out of range,
                                 prompt too long, scheduler INVALID_ARGUMENT
 401     authentication_error    --api-key set and the bearer token missing or wrong
 404     not_found_error         unknown model, unknown path
 405     invalid_request_error   a known path with the wrong method
 429     rate_limit_error        the scheduler's waiting queue is full, or too many requests on this
                                 frontend (Retry-After: 1)
 500     internal_error          a bug
 503     service_unavailable     scheduler unreachable or not ready, draining, cut by a drain
                                 (Retry-After: 1)
 504     timeout_error           the scheduler's deadline passed
 499     cancelled               the client went away (nobody reads it)
```
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from pagedserve.frontend.openai.bodies import error_body
from pagedserve.frontend.generation.errors import ErrorKind, RequestError, classify

RETRY_AFTER_S = 1

_OF_KIND = {  # ErrorKind -> (status, type, code)
    ErrorKind.INVALID: (400, "invalid_request_error", None),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    ErrorKind.BUSY: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    ErrorKind.TIMEOUT: (504, "timeout_error", "timeout"),
    ErrorKind.CANCELLED: (499, "cancelled", "client_closed_request"),  # the client is gone: unread
    ErrorKind.INTERNAL: (500, "internal_error", "internal_error"),
}


class HttpError(Exception):
    """A failure that only the HTTP API has (authentication, routing, models)."""

    def __init__(self, status: int, error_type: str, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.param = param
        self.code = code


def unknown_model(name: str, served_name: str) -> HttpError:
    return HttpError(404, "not_found_error", f"the model {name!r} does not exist; this server serves {served_name!r}",
                     param="model", code="model_not_found")


def unauthorized() -> HttpError:
    return HttpError(401, "authentication_error", "missing or wrong API key (send Authorization: Bearer KEY)",
                     code="invalid_api_key")


def http_status(error: RequestError) -> int:
    """The HTTP status of a classified failure."""
    return _OF_KIND[error.kind][0]


def error_parts(exc: BaseException) -> tuple[int, dict, str]:
    """(HTTP status, OpenAI error body, metrics label) of any failure."""
    if isinstance(exc, HttpError):
        return exc.status, error_body(str(exc), exc.error_type, exc.param, exc.code), "rejected"
    error = classify(exc)
    status, error_type, code = _OF_KIND[error.kind]
    return status, error_body(error.message, error_type, error.param, code), error.metrics_label


def error_response(exc: BaseException) -> JSONResponse:
    status, body, _label = error_parts(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)
