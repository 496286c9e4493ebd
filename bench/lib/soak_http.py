"""One soak request over the OpenAI-compatible HTTP API (POST /v1/completions, stream=true), as
soak.py sends one over gRPC: a blocking HTTP/1.1 client on a thread of the soak's pool.

A request cut at a random point closes its connection after that many SSE chunks (zero: as soon
as the status line came), which the frontend takes as the client leaving: it aborts the request.
The outcome of a stream that runs to its end is checked against its usage chunk
(stream_options.include_usage): completion_tokens must be max_tokens * n.
"""

from __future__ import annotations

import http.client
import json

REFUSED_STATUSES = (429, 503)  # queue full, scheduler not ready: safe to retry (README, "Errors")


class HttpRefused(Exception):
    """Refused before the stream began (a status of REFUSED_STATUSES, or no connection): retryable."""


class HttpFailed(Exception):
    """The stream began and went wrong: an error frame, a cut connection, a wrong token count."""


def completion_body(model: str, request) -> bytes:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens, "n": request.n,
            "temperature": request.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if request.temperature:
        body["seed"] = request.seed
    return json.dumps(body).encode()


def http_stream_once(host: str, port: int, model: str, request) -> tuple[str, int, int]:
    """("completed" | "cancelled", SSE chunks read, completion tokens); raises HttpRefused before
    the stream began, HttpFailed after."""
    connection = http.client.HTTPConnection(host, port, timeout=600)
    num_chunks = 0
    try:
        try:
            connection.request("POST", "/v1/completions", completion_body(model, request),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
        except OSError as exc:  # refused while the frontend restarts, reset as it dies
            raise HttpRefused(f"{type(exc).__name__}: {exc}") from exc
        if response.status in REFUSED_STATUSES:
            raise HttpRefused(f"HTTP {response.status}")
        if response.status != 200:
            raise HttpFailed(f"HTTP {response.status}: {response.read()[:300]!r}")
        if request.cancel_after == 0:
            return "cancelled", 0, 0
        usage = None
        is_done = False
        try:
            for line in response:
                if line.startswith(b"event: error"):
                    raise HttpFailed(f"error frame after {num_chunks} chunks")
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    is_done = True
                    break
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    raise HttpFailed(f"error after {num_chunks} chunks: {chunk['error'].get('message')}")
                if chunk.get("choices"):
                    num_chunks += 1
                    if request.cancel_after is not None and num_chunks >= request.cancel_after:
                        return "cancelled", num_chunks, 0
                elif chunk.get("usage"):
                    usage = chunk["usage"]
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise HttpFailed(f"stream cut after {num_chunks} chunks: {type(exc).__name__}: {exc}") from exc
        if not is_done or usage is None:
            raise HttpFailed(f"stream ended after {num_chunks} chunks without {'usage' if is_done else '[DONE]'}")
        if usage["completion_tokens"] != request.max_tokens * request.n:
            raise HttpFailed(f"{usage['completion_tokens']} tokens, expected {request.max_tokens * request.n}")
        return "completed", num_chunks, usage["completion_tokens"]
    finally:
        connection.close()
