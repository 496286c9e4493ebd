"""POST /v1/completions and /v1/chat/completions: parse, prepare, run, answer.

```
 body ─parse (openai_protocol)─▶ plan ─prepare (worker thread)─────────▶ GenerationRun ─▶ whole JSON
        400 invalid_request_error       limits (503 draining/not ready),     one Generation   or SSE
        404 unknown model               chat template, tokenize, validate    per prompt       (openai_streaming)
```

Nothing is sent before the first update has arrived, so a failure that comes first (the
scheduler's RESOURCE_EXHAUSTED, UNAVAILABLE) is an HTTP status (429, 503) that a client or proxy
can retry; a failure after that is an SSE error frame. A client that disconnects while its
request runs, streamed or not, cancels the run, which aborts it in the scheduler and frees its
blocks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.frontend.generation.admission import Admission
from pagedserve.frontend.generation.errors import RequestFailed
from pagedserve.frontend.tokenization.chat_template import ChatTemplate
from pagedserve.frontend.openai.generation_run import GenerationRun
from pagedserve.frontend.openai.errors import HttpError, error_parts, error_response, http_status, unknown_model
from pagedserve.frontend.metrics import FrontendMetrics
from pagedserve.frontend.openai.protocol import (
    ChatCompletionBody, ChatMessage, CompletionBody, GenerationPlan, chat_messages, generation_plan, parse_body,
    prompts_of, unknown_fields,
)
from pagedserve.frontend.openai.bodies import (
    ResponseHeader, TokenTexts, chat_choice, chat_logprobs, chat_response, completion_choice, completion_logprobs,
    completion_response, total_usage,
)
from pagedserve.frontend.openai.streaming import ChunkWriter, WatchedStreamingResponse, sse_frames
from pagedserve.frontend.generation.stream_watchdog import DEFAULT_STREAM_WRITE_TIMEOUT_S
from pagedserve.frontend.grpc.validation import ValidatedRequest, check_text_bytes, check_token_ids, validate_lengths
from pagedserve.frontend.tools.tool_parsers import get_parser
from pagedserve.frontend.tools.tool_request import ToolSettings
from pagedserve.frontend.tools.tool_stream import message_content, tool_call_body
from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.checkpoints.generation_defaults import NEUTRAL, SamplingDefaults
from pagedserve.contracts.request_types import AdapterRef
from pagedserve.frontend.lora.registry import AdapterRegistry, UnknownAdapter

log = structlog.get_logger()
PROTOCOL = "http"  # the `protocol` label of the frontend metrics
BodyReader = Callable[[], Awaitable[Any]]  # the request body, parsed JSON (InvalidParameter when not)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


@dataclass(slots=True)
class PreparedRequest:
    requests: list[ValidatedRequest]  # one per prompt
    echo_texts: list[str] | None  # per prompt, with echo


class ConcurrencyLimit:
    """Generations running for HTTP clients at once; beyond it a request gets 429 at once."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self._running = 0
        self._lock = threading.Lock()

    def acquire(self, count: int) -> None:
        with self._lock:
            if self._running + count > self.max_running:
                raise HttpError(429, "rate_limit_error", f"too many requests on this frontend (at most "
                                f"{self.max_running} prompts run at once); retry later", code="too_many_requests")
            self._running += count

    def release(self, count: int) -> None:
        with self._lock:
            self._running -= count

    def release_one(self) -> None:
        self.release(1)


class OpenAIServing:
    def __init__(self, admission: Admission, metrics: FrontendMetrics, chat_template: ChatTemplate,
                 served_model_name: str, executor: Executor, limit: ConcurrencyLimit, *,
                 stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S,
                 max_undelivered_messages: int | None = None, tool_settings: ToolSettings = ToolSettings(),
                 sampling_defaults: SamplingDefaults = NEUTRAL, adapters: AdapterRegistry | None = None) -> None:
        """stream_write_timeout_s: how long one SSE write may wait for a client that is not reading;
        max_undelivered_messages: updates of a request left unread before it is aborted;
        tool_settings: --tool-call-parser and --enable-auto-tool-choice; sampling_defaults: the
        model's, for what a request leaves out; adapters: the LoRA adapters `model` may name besides
        the base (None: --enable-lora is off)."""
        self.adapters = adapters
        self._admission = admission
        self._tool_settings = tool_settings
        self.stream_write_timeout_s = stream_write_timeout_s
        self._max_undelivered_messages = max_undelivered_messages
        self.metrics = metrics
        self._chat_template = chat_template
        self.served_model_name = served_model_name
        self.executor = executor
        self._limit = limit
        self._token_text = TokenTexts(admission.tokenizer)
        self.sampling_defaults = sampling_defaults

    @property
    def tool_settings(self) -> ToolSettings:
        return self._tool_settings

    def tool_parser_name(self, plan: GenerationPlan) -> str | None:
        """The parser of a chat request whose output may hold tool calls, else None."""
        return self._tool_settings.parser if plan.tools is not None and plan.tools.is_active else None

    def check_model(self, name: str | None) -> None:
        self.resolve_model(name)

    def resolve_model(self, name: str | None) -> AdapterRef | None:
        """The LoRA adapter `model` names, None for the base model; 404 for an unknown name."""
        if name is None or name == self.served_model_name:
            return None
        if self.adapters is None:
            raise unknown_model(name, self.served_model_name)
        try:
            return self.adapters.resolve(name)
        except UnknownAdapter:
            served = ", ".join([self.served_model_name, *sorted(spec.name for spec in self.adapters.adapters())])
            raise unknown_model(name, served) from None

    async def completions(self, request: Request, read_body: BodyReader, request_id: str) -> Response:
        return await self._serve(request, read_body, request_id, is_chat=False)

    async def chat_completions(self, request: Request, read_body: BodyReader, request_id: str) -> Response:
        return await self._serve(request, read_body, request_id, is_chat=True)

    async def _serve(self, request: Request, read_body: BodyReader, request_id: str, *, is_chat: bool) -> Response:
        timer = self.metrics.start_request(PROTOCOL)
        loop = asyncio.get_running_loop()
        try:
            body = await read_body()
            body_class = ChatCompletionBody if is_chat else CompletionBody
            parsed = parse_body(body_class, body)
            unknown = unknown_fields(body_class, body)
            if unknown:
                log.info("request_unknown_fields", fields=unknown)  # request_id is bound by the middleware
            adapter = self.resolve_model(parsed.model)
            plan = generation_plan(parsed, self.sampling_defaults, tool_settings=self._tool_settings)
            if plan.user is not None:
                log.info("request_user", user=plan.user)
            prepared = await loop.run_in_executor(self.executor, self.prepare, parsed, plan, request_id, is_chat)
            for validated in prepared.requests:
                validated.adapter = adapter
            run = self.start_run(prepared, timer, loop, whole=not plan.is_stream)
        except Exception as exc:
            return self.refused(exc, timer)
        header = ResponseHeader(f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id}", int(time.time()),
                                parsed.model if adapter is not None else self.served_model_name)
        try:
            if plan.is_stream:
                first = await unless_disconnected(request, run.next())
                writer = ChunkWriter(header, is_chat=is_chat, num_choices=plan.num_choices,
                                     num_top_logprobs=plan.num_top_logprobs, include_usage=plan.include_usage,
                                     token_text=self._token_text, echo_texts=prepared.echo_texts,
                                     tool_parser=self.tool_parser_name(plan),
                                     prompt_lens=[len(r.prompt_token_ids) for r in prepared.requests]
                                     if plan.continuous_usage else None)
                # The background task also runs when the client left before the stream started
                # (Starlette then never starts the frames' generator, so its cleanup cannot).
                return WatchedStreamingResponse(
                    sse_frames(first, run, writer, lambda exc: error_parts(exc)[1]), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    background=BackgroundTask(cancel_unless_finished, run),
                    write_timeout_s=self.stream_write_timeout_s, on_timeout=self.on_write_timeout(run, request_id))
            await unless_disconnected(request, run.collect())
            return JSONResponse(self._whole(header, run, plan, prepared, is_chat))
        except ClientGone:
            run.cancel()
            return Response(status_code=499)  # nobody reads it; the access log shows it
        except Exception as exc:
            run.cancel()
            return error_response(exc)

    def on_write_timeout(self, run: GenerationRun, request_id: str) -> Callable[[], None]:
        def on_timeout() -> None:
            log.warning("stream_write_timeout", request_id=request_id,
                        stream_write_timeout=self.stream_write_timeout_s)
            run.cancel()  # aborted in the scheduler: its blocks are freed

        return on_timeout

    def start_run(self, prepared: PreparedRequest, timer, loop: asyncio.AbstractEventLoop, *,
                  whole: bool = False) -> GenerationRun:
        """One Generation per prompt, running; each holds a slot of the limit until its pump ends.
        whole: the response is sent at the end, not streamed."""
        num_prompts = len(prepared.requests)
        self._limit.acquire(num_prompts)
        run = GenerationRun(self._admission, self.executor, loop, on_pump_end=self._limit.release_one,
                            max_undelivered=self._max_undelivered_messages)
        timers = [timer] + [self.metrics.start_request(PROTOCOL) for _ in range(num_prompts - 1)]
        try:
            run.start(prepared.requests, timers, whole=whole)
        except BaseException:
            self._limit.release(num_prompts)
            raise
        return run

    def refused(self, exc: Exception, timer) -> Response:
        """A request that failed before its run started."""
        if isinstance(exc, HttpError):  # the HTTP API's own refusals (unknown model, too many requests)
            timer.on_done("rejected")
            log.info("request_failed", code=exc.status, error=str(exc), param=exc.param)
            return error_response(exc)
        return error_response(RequestFailed(self._admission.failed(exc, timer, code_of=http_status)))

    def encode_messages(self, messages: list[ChatMessage], add_generation_prompt: bool, max_bytes: int,
                        tools: list[dict] | None = None) -> list[int]:
        """Chat messages rendered by the chat template (with the request's tools, when it has active
        ones), as token ids (their texts checked against max_bytes first)."""
        rendered = chat_messages(messages)
        check_text_bytes("messages", [m["content"] for m in rendered], max_bytes)
        return self._chat_template.encode(rendered, add_generation_prompt, tools)

    def encode_text(self, field_name: str, text: str, max_bytes: int, add_special_tokens: bool = True) -> list[int]:
        """A text prompt as token ids (checked against max_bytes first)."""
        check_text_bytes(field_name, [text], max_bytes)
        return self._admission.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def prepare(self, parsed, plan: GenerationPlan, request_id: str, is_chat: bool) -> PreparedRequest:
        """On a worker thread: limits (draining, readiness), chat template, tokens, validation."""
        limits = self._admission.limits()
        tokenizer = self._admission.tokenizer
        if is_chat:
            tools = plan.tools.template_tools() if plan.tools is not None and plan.tools.is_active else None
            prompts: list[tuple[str, list[int]]] = [
                ("messages", self.encode_messages(parsed.messages, parsed.add_generation_prompt,
                                                  limits.max_prompt_bytes, tools))]
        else:
            prompts = []
            items = prompts_of(parsed)
            for index, item in enumerate(items):
                field_name = "prompt" if len(items) == 1 else f"prompt[{index}]"
                if isinstance(item, str):
                    prompts.append((field_name, self.encode_text(field_name, item, limits.max_prompt_bytes)))
                else:
                    check_token_ids(field_name, item, limits.vocab_size)
                    prompts.append((field_name, list(item)))
        requests = []
        for index, (field_name, token_ids) in enumerate(prompts):
            if not token_ids:
                raise InvalidParameter(field_name, "encodes to no tokens")
            params = plan.resolve(len(token_ids), limits.max_model_len)
            try:
                params.validate(vocab_size=limits.vocab_size)
            except InvalidParameter as exc:
                raise plan.rename(exc) from None
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            requests.append(validate_lengths(ValidatedRequest(sub_id, token_ids, params, plan.priority), limits, field_name,
                                             max_tokens_field=plan.max_tokens_field))
        echo_texts = None
        if plan.echo:
            echo_texts = [item if isinstance(item, str) else tokenizer.decode(item) for item in prompts_of(parsed)]
        return PreparedRequest(requests, echo_texts)

    def _whole(self, header: ResponseHeader, run: GenerationRun, plan: GenerationPlan, prepared: PreparedRequest,
               is_chat: bool) -> dict:
        choices = []
        parser_name = self.tool_parser_name(plan)
        for prompt_index, generation in enumerate(run.generations):
            states = sorted(generation.states, key=lambda state: state.index)[:plan.num_choices]
            for state in states:
                index = prompt_index * plan.num_choices + state.index
                text = state.text
                if prepared.echo_texts is not None:
                    text = prepared.echo_texts[prompt_index] + text
                logprobs = None
                if plan.num_top_logprobs is not None:
                    logprobs = (chat_logprobs(state.logprobs, plan.num_top_logprobs, self._token_text) if is_chat
                                else completion_logprobs(state.logprobs, plan.num_top_logprobs, self._token_text, 0))
                if parser_name is not None:
                    parsed_output = get_parser(parser_name).parse(text)
                    choices.append(chat_choice(index, message_content(parsed_output), state.finish, logprobs,
                                               [tool_call_body(call) for call in parsed_output.calls]))
                    continue
                choice_of = chat_choice if is_chat else completion_choice
                choices.append(choice_of(index, text, state.finish, logprobs))
        usage = total_usage([run.usages[index] for index in sorted(run.usages)])
        return (chat_response if is_chat else completion_response)(header, choices, usage)


async def cancel_unless_finished(run: GenerationRun) -> None:
    if not run.is_finished:
        run.cancel()


async def unless_disconnected(request: Request, awaitable):
    """Awaits `awaitable`, or raises ClientGone as soon as the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
