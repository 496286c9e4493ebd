"""Server-sent events as OpenAI streams them, from the updates of a GenerationRun.

```
 data: {chunk}\\n\\n        one choice per chunk, naming its `index`
   chat:         first a {"role": "assistant", "content": ""} delta per choice, then
                 {"content": …} deltas; finish_reason (stop | length) on the choice's last chunk
   completions:  {"text": …} (with echo, the first chunk of a choice starts with the prompt)
   include_usage: every chunk has "usage": null, and a last chunk has "choices": [] and the usage
   continuous_usage_stats (vLLM's): every chunk's "usage" counts its choice's prompt tokens and the
                 tokens generated so far (with include_usage, the last chunk still sums them all)
 event: error\\ndata: {"error": {…}}\\n\\n   a failure after the stream began
 data: [DONE]\\n\\n
```

A client that stops reading stalls the response's writes (uvicorn waits for the socket to drain):
WatchedStreamingResponse gives each write --stream-write-timeout, past which it aborts the run
(blocks freed in the scheduler) and aborts the connection: closed at once, its unsent bytes
dropped (connection_abort.py; a plain close would wait for a client that never reads).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.frontend.generation.completion_state import CompletionUpdate
from pagedserve.frontend.generation.updates import GenerationUpdate
from pagedserve.frontend.openai.connection_abort import abort_connection
from pagedserve.frontend.openai.generation_run import GenerationRun
from pagedserve.frontend.tools.tool_parsers import get_parser
from pagedserve.frontend.tools.tool_stream import ToolStream
from pagedserve.frontend.openai.bodies import (
    ResponseHeader, TokenTexts, chat_logprobs, completion_logprobs, finish_reason, total_usage, usage_body,
)

DONE_FRAME = b"data: [DONE]\n\n"


def dumps(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def data_frame(body: dict) -> bytes:
    return b"data: " + dumps(body) + b"\n\n"


def error_frame(body: dict) -> bytes:
    return b"event: error\ndata: " + dumps(body) + b"\n\n"


class ChunkWriter:
    """Turns one request's updates into chunk bodies; remembers per choice what was sent."""

    def __init__(self, header: ResponseHeader, *, is_chat: bool, num_choices: int, num_top_logprobs: int | None,
                 include_usage: bool, token_text: TokenTexts, echo_texts: list[str] | None = None,
                 tool_parser: str | None = None, prompt_lens: list[int] | None = None) -> None:
        """tool_parser: the --tool-call-parser of a chat request with tools: each choice's text goes
        through a ToolStream (content and tool_calls deltas, partial tags held back). prompt_lens:
        each prompt's token count, given for continuous usage (every chunk its choice's usage)."""
        self._header = header
        self._is_chat = is_chat
        self._num_choices = num_choices
        self._num_top_logprobs = num_top_logprobs
        self._include_usage = include_usage
        self._token_text = token_text
        self._echo_texts = echo_texts  # per prompt; None without echo
        self._num_chars: dict[int, int] = {}  # choice -> characters sent (logprobs text_offset)
        self._tool_parser = tool_parser
        self._tool_streams: dict[int, ToolStream] = {}  # choice -> its calls so far
        self._prompt_lens = prompt_lens
        self._num_tokens: dict[int, int] = {}  # choice -> tokens generated so far (continuous usage)

    def opening(self, num_prompts: int) -> list[dict]:
        """Chat: the assistant role, once per choice, before any content."""
        if not self._is_chat:
            return []
        return [self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
                for index in range(num_prompts * self._num_choices)]

    def chunks(self, prompt_index: int, update: GenerationUpdate) -> list[dict]:
        if self._prompt_lens is not None:
            for completion in update.completions:
                index = prompt_index * self._num_choices + completion.index
                self._num_tokens[index] = self._num_tokens.get(index, 0) + len(completion.token_ids)
        if self._tool_parser is not None:
            return [chunk for completion in update.completions if completion.index < self._num_choices
                    for chunk in self._tool_chunks(prompt_index, completion)]
        return [self._choice_chunk(prompt_index, completion) for completion in update.completions
                if completion.index < self._num_choices]

    def _tool_chunks(self, prompt_index: int, completion: CompletionUpdate) -> list[dict]:
        """A choice's update as content and tool_calls deltas; the last chunk has finish_reason
        (tool_calls when the choice made calls and was not cut by the length)."""
        index = prompt_index * self._num_choices + completion.index
        stream = self._tool_streams.get(index)
        if stream is None:
            stream = self._tool_streams[index] = ToolStream(get_parser(self._tool_parser))
        deltas = stream.feed(completion.text)
        logprobs = None
        if self._num_top_logprobs is not None:
            logprobs = chat_logprobs(completion.logprobs, self._num_top_logprobs, self._token_text)
        if completion.finish is not None:
            deltas += stream.finish()
        chunks = [self._chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
                  for delta in deltas]
        if logprobs is not None:
            if chunks:
                chunks[0]["choices"][0]["logprobs"] = logprobs
            else:
                chunks.append(self._chunk({"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": None}))
        if completion.finish is not None:
            reason = finish_reason(completion.finish)
            if stream.has_calls and reason == "stop":
                reason = "tool_calls"
            chunks.append(self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}))
        return chunks

    def closing(self, run: GenerationRun) -> list[dict]:
        """The usage chunk, when the client asked for it."""
        if not self._include_usage:
            return []
        usage = total_usage([run.usages[index] for index in sorted(run.usages)])
        return [{"id": self._header.response_id, "object": self._object, "created": self._header.created,
                 "model": self._header.model, "choices": [], "usage": usage_body(usage)}]

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self._is_chat else "text_completion"

    def _chunk(self, choice: dict) -> dict:
        chunk = {"id": self._header.response_id, "object": self._object, "created": self._header.created,
                 "model": self._header.model, "choices": [choice]}
        if self._prompt_lens is not None:
            index = choice["index"]
            prompt_tokens = self._prompt_lens[index // self._num_choices]
            num_tokens = self._num_tokens.get(index, 0)
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
                              "total_tokens": prompt_tokens + num_tokens}
        elif self._include_usage:
            chunk["usage"] = None
        return chunk

    def _choice_chunk(self, prompt_index: int, completion: CompletionUpdate) -> dict:
        index = prompt_index * self._num_choices + completion.index
        text = completion.text
        is_first = index not in self._num_chars
        if is_first and self._echo_texts is not None:
            text = self._echo_texts[prompt_index] + text
        offset = self._num_chars.get(index, 0)
        self._num_chars[index] = offset + len(text)
        logprobs = None
        if self._num_top_logprobs is not None:
            if self._is_chat:
                logprobs = chat_logprobs(completion.logprobs, self._num_top_logprobs, self._token_text)
            else:
                echo_chars = len(self._echo_texts[prompt_index]) if is_first and self._echo_texts else 0
                logprobs = completion_logprobs(completion.logprobs, self._num_top_logprobs, self._token_text,
                                               offset + echo_chars)
        if self._is_chat:
            choice = {"index": index, "delta": {"content": text} if text or completion.finish is None else {},
                      "logprobs": logprobs, "finish_reason": finish_reason(completion.finish)}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason(completion.finish)}
        return self._chunk(choice)


async def sse_frames(first: tuple[int, GenerationUpdate] | None, run: GenerationRun, writer: ChunkWriter,
                     error_body: Callable[[BaseException], dict]) -> AsyncIterator[bytes]:
    """The frames of a stream whose first update has arrived; a client that goes away cancels the
    iteration (Starlette cancels it on disconnect), which cancels the run."""
    try:
        for chunk in writer.opening(len(run.generations)):
            yield data_frame(chunk)
        item = first
        while item is not None:
            for chunk in writer.chunks(*item):
                yield data_frame(chunk)
            item = await run.next()
        for chunk in writer.closing(run):
            yield data_frame(chunk)
    except Exception as exc:  # after the status line: the error travels in the stream
        yield error_frame(error_body(exc))
    finally:
        if not run.is_finished:
            run.cancel()
    yield DONE_FRAME


class WatchedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every body write must complete within write_timeout_s; past it
    on_timeout() is called, the connection is aborted and the response ends unfinished."""

    def __init__(self, content: AsyncIterator[bytes], *, write_timeout_s: float, on_timeout: Callable[[], None],
                 **options) -> None:
        super().__init__(content, **options)
        self._write_timeout_s = write_timeout_s
        self._on_timeout = on_timeout
        self._scope: Scope = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope  # holds the connection's transport (connection_abort.expose_transport)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            try:
                await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                       self._write_timeout_s)
            except TimeoutError:
                self._on_timeout()
                abort_connection(self._scope)  # not left half-open on a client that never reads
                await self.body_iterator.aclose()
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
