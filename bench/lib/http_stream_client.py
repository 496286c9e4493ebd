"""Sends benchmark requests to the OpenAI-compatible HTTP API (POST /v1/completions, stream=true)
and times every token, as stream_client.py does over gRPC.

One asyncio task and one connection per request, a raw HTTP/1.1 client on asyncio streams (no
client library's overhead in the numbers): the body carries the prompt's token ids, greedy
sampling, ignore_eos and stream_options.include_usage. Each SSE chunk is stamped on arrival; a
chunk carries one scheduler update, which is one token for these greedy single-choice requests,
and the usage chunk at the end confirms the count.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from lib.stream_client import RequestTrace
from lib.workload import BenchRequest


class HttpBenchError(RuntimeError):
    """A request failed (not 200, or its token count disagrees with its usage)."""


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def completion_body(model: str, request: BenchRequest) -> bytes:
    return json.dumps({"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _chunks(reader: asyncio.StreamReader):
    """The pieces of a chunked transfer-encoded body, as they arrive."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def _one(host: str, port: int, model: str, request: BenchRequest, trace: RequestTrace, start: float,
               delay: float, on_done) -> None:
    if delay > 0:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    reader, writer = await asyncio.open_connection(host, port)
    body = completion_body(model, request)
    trace.sent_at = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), port, len(body), body))
    try:
        status, headers = await _read_head(reader)
        if status != 200:
            raise HttpBenchError(f"HTTP {status}: {(await reader.read()).decode(errors='replace')[:300]}")
        if headers.get("transfer-encoding") != "chunked":
            raise HttpBenchError(f"expected a chunked stream, got headers {headers}")
        buffer, usage = b"", None
        async for piece in _chunks(reader):
            now = time.perf_counter()
            buffer += piece
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                if frame == b"data: [DONE]" or not frame.startswith(b"data: "):
                    continue
                chunk = json.loads(frame[6:])
                if chunk["choices"]:
                    trace.token_times.append(now)
                elif chunk.get("usage"):
                    usage = chunk["usage"]
        if usage is None or usage["completion_tokens"] != trace.num_tokens:
            raise HttpBenchError(f"{trace.num_tokens} chunks for usage {usage}")
    finally:
        writer.close()
    trace.finished_at = time.perf_counter()
    on_done()


async def _run_all(base_url: str, requests: list[BenchRequest], arrivals: list[float] | None,
                   on_done) -> list[RequestTrace]:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    model = await asyncio.to_thread(served_model, base_url)
    traces = [RequestTrace(request.prompt_len, request.max_tokens) for request in requests]
    start = time.perf_counter()
    delays = arrivals or [0.0] * len(requests)
    await asyncio.gather(*(_one(host, int(port), model, request, trace, start, delay, on_done)
                           for request, trace, delay in zip(requests, traces, delays)))
    return traces


def run_http_requests(base_url: str, requests: list[BenchRequest], arrivals: list[float] | None = None,
                      on_done=lambda: None) -> list[RequestTrace]:
    """Blocks until every request finished; arrivals are seconds after the start, one per request."""
    return asyncio.run(_run_all(base_url, requests, arrivals, on_done))
