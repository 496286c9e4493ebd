"""The OpenAI-compatible HTTP API of the frontend (a FastAPI app; server.py serves it).

```
 POST /v1/completions  POST /v1/chat/completions   serving.py (streamed or whole)
 POST /v1/responses                                responses/ (stateless; streamed or whole)
 GET  /v1/models       GET  /v1/models/{model}     the served model and its LoRA adapters
 POST /v1/load_lora_adapter  /v1/unload_lora_adapter    lora_routes.py (when allowed)
 GET  /health                                      200 ready, 503 not ready or draining (no API key)
 POST /tokenize        POST /detokenize            vLLM's shapes
 GET  /version
```

Every request passes `HttpEdge` first: it takes the request id (`x-request-id`, else a fresh one,
sent back in `x-request-id`), checks the API key when one is set, binds `request_id` and
`protocol` to the log lines of the request, and writes one `http_request` access log line with
status and latency once the answer (the whole stream, for a stream) is sent. Bodies are read
here, not by FastAPI: a body over --max-request-bytes, not UTF-8, not JSON, or a JSON string with
a lone surrogate is a 400 naming `body`, never FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from concurrent.futures import Executor

import structlog
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import pagedserve
from pagedserve.frontend.generation.admission import Admission
from pagedserve.frontend.openai.errors import HttpError, error_response, unauthorized
from pagedserve.frontend.openai.protocol import DetokenizeBody, TokenizeBody, parse_body
from pagedserve.frontend.openai.bodies import error_body, model_card
from pagedserve.frontend.openai.serving import OpenAIServing
from pagedserve.frontend.openai.responses.serving import ResponsesServing
from pagedserve.frontend.openai.lora_routes import adapter_cards, add_runtime_lora_routes
from pagedserve.contracts.sampling_params import InvalidParameter

log = structlog.get_logger()
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 256
OPEN_PATHS = ("/health",)  # answered without an API key
MAX_DISCARDED_BYTES = 256 * 2**20  # of a body over the limit; past this the connection is dropped


class HttpEdge:
    """ASGI middleware: request id, API key, log context and the access log line."""

    def __init__(self, app, api_key: str | None) -> None:
        self._app = app
        self._api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = dict(scope["headers"])
        request_id = _request_id(headers.get(REQUEST_ID_HEADER.encode(), b""))
        scope.setdefault("state", {})["request_id"] = request_id
        status = {"code": 0}

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), request_id.encode())]
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id, protocol="http"):
            try:
                if self._api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
                    await error_response(unauthorized())(scope, receive, send_with_id)
                else:
                    await self._app(scope, receive, send_with_id)
            finally:
                # probes poll /health every few seconds: their lines are debug, the rest info
                write = log.debug if scope["path"] in OPEN_PATHS and status["code"] == 200 else log.info
                write("http_request", method=scope["method"], path=scope["path"], status=status["code"],
                      latency_ms=round((time.perf_counter() - started) * 1e3, 3))

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self._api_key)


def _request_id(header: bytes) -> str:
    try:
        text = header.decode("ascii").strip()
    except UnicodeDecodeError:
        text = ""
    if text and len(text) <= MAX_REQUEST_ID_CHARS and text.isprintable():
        return text
    return uuid.uuid4().hex


async def read_json(request: Request, max_bytes: int):
    """The request body parsed as JSON; InvalidParameter("body") for what is not. A body over
    max_bytes is read to its end and dropped (up to MAX_DISCARDED_BYTES), so the client, still
    sending, gets the 400 rather than a reset connection."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= max_bytes:
            chunks.append(chunk)
        elif size > MAX_DISCARDED_BYTES:
            break
    if size > max_bytes:
        raise InvalidParameter("body", f"the body is larger than {max_bytes} bytes (--max-request-bytes)")
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidParameter("body", f"not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise InvalidParameter("body", "the body is empty; send a JSON object")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidParameter("body", f"not valid JSON: {exc}") from None
    _reject_lone_surrogates(body)
    return body


def _reject_lone_surrogates(body) -> None:
    """JSON may escape half a UTF-16 pair (\\ud800); such a string cannot be encoded: refuse it."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidParameter("body", "a string holds a lone UTF-16 surrogate (not valid Unicode)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def build_app(admission: Admission, serving: OpenAIServing, executor: Executor, *,
              api_key: str | None, max_request_bytes: int, allow_runtime_lora_updating: bool = False) -> HttpEdge:
    """The ASGI app of the HTTP port."""
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    started = int(time.time())
    tokenizer = admission.tokenizer

    def max_model_len() -> int | None:
        info = admission.readiness.info
        return info.max_model_len if info is not None else None

    async def guarded(request: Request, handler) -> Response:
        try:
            return await handler()
        except (InvalidParameter, HttpError) as exc:
            log.info("request_refused", path=request.url.path, error=str(exc))
            return error_response(exc)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await guarded(request, lambda: _generate(request, serving.completions))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await guarded(request, lambda: _generate(request, serving.chat_completions))

    async def _generate(request: Request, handler) -> Response:
        return await handler(request, lambda: read_json(request, max_request_bytes),
                             request.scope["state"]["request_id"])

    responses_serving = ResponsesServing(serving)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await guarded(request, lambda: _generate(request, responses_serving.responses))

    @app.get("/v1/models")
    async def models() -> Response:
        card = model_card(serving.served_model_name, started, max_model_len(), serving.sampling_defaults)
        return JSONResponse({"object": "list",
                             "data": [card, *adapter_cards(serving.adapters, started, max_model_len())]})

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        async def answer() -> Response:
            adapter = serving.resolve_model(model)
            if adapter is not None:
                cards = adapter_cards(serving.adapters, started, max_model_len())
                return JSONResponse(next((card for card in cards if card["id"] == model),
                                         model_card(model, started, max_model_len())))
            return JSONResponse(model_card(model, started, max_model_len(), serving.sampling_defaults))
        return await guarded(request, answer)

    if allow_runtime_lora_updating and serving.adapters is not None:
        add_runtime_lora_routes(app, serving.adapters, lambda request: read_json(request, max_request_bytes),
                                guarded)

    @app.get("/health")
    async def health() -> Response:
        if admission.is_serving:
            return JSONResponse({"status": "ok"})
        reason = "draining" if admission.in_flight.is_draining else "the scheduler is not ready"
        return JSONResponse(error_body(f"not ready: {reason}", "service_unavailable", code="service_unavailable"),
                            status_code=503, headers={"Retry-After": "1"})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        async def answer() -> Response:
            body = parse_body(TokenizeBody, await read_json(request, max_request_bytes))
            serving.check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise InvalidParameter("prompt", "send exactly one of prompt or messages")

            max_bytes = admission.max_prompt_bytes()

            def encode() -> list[int]:
                if body.messages is not None:
                    return serving.encode_messages(body.messages, body.add_generation_prompt, max_bytes)
                add_special = True if body.add_special_tokens is None else body.add_special_tokens
                return serving.encode_text("prompt", body.prompt, max_bytes, add_special)

            token_ids = await asyncio.get_running_loop().run_in_executor(executor, encode)
            return JSONResponse({"count": len(token_ids), "max_model_len": max_model_len(), "tokens": token_ids})
        return await guarded(request, answer)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def answer() -> Response:
            body = parse_body(DetokenizeBody, await read_json(request, max_request_bytes))
            serving.check_model(body.model)
            for position, token_id in enumerate(body.tokens):
                if not 0 <= token_id < tokenizer.vocab_size:
                    raise InvalidParameter("tokens", f"token id {token_id} at position {position} is outside "
                                           f"the vocabulary (size {tokenizer.vocab_size})")
            return JSONResponse({"prompt": tokenizer.decode(body.tokens)})
        return await guarded(request, answer)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": pagedserve.__version__})

    @app.exception_handler(HTTPException)
    async def http_exception(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(HttpError(404, "not_found_error", f"no such path: {request.method} "
                                            f"{request.url.path}", code="unknown_url"))
        if exc.status_code == 405:
            return error_response(HttpError(405, "invalid_request_error", f"{request.method} is not allowed on "
                                            f"{request.url.path}", code="method_not_allowed"))
        return error_response(HttpError(exc.status_code, "invalid_request_error", str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_exception(request: Request, exc: RequestValidationError) -> Response:
        return error_response(InvalidParameter("body", str(exc)))

    @app.exception_handler(Exception)
    async def internal_exception(request: Request, exc: Exception) -> Response:
        log.error("http_internal_error", path=request.url.path, exc_info=exc)
        return error_response(exc)

    return HttpEdge(app, api_key)
