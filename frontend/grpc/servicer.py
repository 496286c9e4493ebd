"""The public pagedserve.v1.Generation service: convert, call, map exceptions to status codes.

```
 InvalidParameter, undecodable request (bad UTF-8), scheduler INVALID_ARGUMENT  -> INVALID_ARGUMENT
 SchedulerBusy (waiting queue full)                                             -> RESOURCE_EXHAUSTED
 SchedulerUnavailable (unreachable, not ready, draining, or lost mid-request and
   no restarted scheduler ready within --scheduler-recovery-timeout), scheduler abort,
 this frontend draining (Draining) or cut at the end of its drain               -> UNAVAILABLE
 SchedulerTimeout, the client's deadline passed                                 -> DEADLINE_EXCEEDED
 the client cancelled the call                                                  -> CANCELLED
 anything else                                                                  -> INTERNAL
```

The kinds come from errors.classify and a failed request is closed (scheduler abort, metrics, log
line) by Admission.failed, as for HTTP; this edge maps the kind to its status code.

A client that cancels, or whose deadline passes, ends the RPC; the RPC's done-callback cancels the
internal Submit stream, which aborts the request in the scheduler and frees its blocks.

The request id is the request's `request_id`, else the `x-request-id` call metadata, else a fresh
one; it is bound to every log line of the call and sent back as `x-request-id` metadata (with the
first response, or in the trailers of an error). Nothing is sent before the first response, so an
error that comes first (RESOURCE_EXHAUSTED, UNAVAILABLE) is a trailers-only response a proxy can
retry elsewhere.
"""

from __future__ import annotations

import contextlib
import threading

import grpc
import structlog

from pagedserve.frontend.generation.admission import Admission
from pagedserve.frontend.generation.generation import Generation
from pagedserve.frontend.metrics import FrontendMetrics, RequestTimer
from pagedserve.frontend.grpc.codec import stream_message, whole_response
from pagedserve.frontend.grpc.tool_calls import StreamedCalls, parse_whole
from pagedserve.frontend.tools.tool_request import ToolSettings
from pagedserve.frontend.upstream.readiness import GENERATION_SERVICE
from pagedserve.frontend.grpc.request_decoding import UndecodableRequest, lenient_deserializer
from pagedserve.frontend.generation.errors import (
    CANCELLED, ErrorKind, RequestError, RequestFailed, UnknownAdapterName, classify)
from pagedserve.frontend.generation.stream_watchdog import StreamWatch, StreamWatchdog
from pagedserve.frontend.upstream.scheduler_client import SchedulerError
from pagedserve.frontend.tokenization.chat_template import ChatTemplate
from pagedserve.checkpoints.generation_defaults import NEUTRAL, SamplingDefaults
from pagedserve.frontend.grpc.validation import check_text_bytes, is_printable_ascii, validate_request
from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.v1 import generation_pb2
from pagedserve.contracts.request_types import AdapterRef
from pagedserve.frontend.lora.registry import AdapterRegistry, UnknownAdapter

log = structlog.get_logger()
NO_DEADLINE_S = 1e6  # time_remaining() above this means the client set no deadline
# A client's deadline passes first on its side; the server learns of it (the call is cancelled)
# a little before its own copy of the deadline: a call cancelled this close to it timed out.
DEADLINE_SLACK_S = 0.25
REQUEST_ID_METADATA = "x-request-id"
PROTOCOL = "grpc"  # the `protocol` label of the frontend metrics

_CODE_OF_KIND = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def _code_name(error: RequestError) -> str:
    return _CODE_OF_KIND[error.kind].name


class CallSlots:
    """The service's own call limit (not grpc.server's maximum_concurrent_rpcs, which would count
    health checks too): a call beyond `max_calls` ends RESOURCE_EXHAUSTED at once."""

    def __init__(self, max_calls: int | None) -> None:
        self.max_calls = max_calls
        self._semaphore = threading.BoundedSemaphore(max_calls) if max_calls is not None else None

    @contextlib.contextmanager
    def slot(self, context):
        if self._semaphore is None:
            yield
            return
        if not self._semaphore.acquire(blocking=False):
            log.info("request_refused", code="RESOURCE_EXHAUSTED", max_concurrent_rpcs=self.max_calls)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.max_calls} calls are running (--max-concurrent-rpcs); retry later")
        try:
            yield
        finally:
            self._semaphore.release()


class GenerationServicer:
    """Implements Generate, GenerateStream, Tokenize and ModelInfo."""

    def __init__(self, admission: Admission, metrics: FrontendMetrics, chat: ChatTemplate | None = None, *,
                 max_concurrent_calls: int | None = None, watchdog: StreamWatchdog | None = None,
                 tool_settings: ToolSettings = ToolSettings(),
                 sampling_defaults: SamplingDefaults = NEUTRAL,
                 adapters: AdapterRegistry | None = None) -> None:
        """admission: the request lifecycle shared with the HTTP API (readiness, drain, recovery);
        chat: renders `messages` prompts (None: such requests are INVALID_ARGUMENT);
        max_concurrent_calls: calls of this service at once, beyond it RESOURCE_EXHAUSTED (None: no
        limit; health and reflection never count); watchdog: cuts streams whose client stops reading;
        sampling_defaults: the model's, for the optional sampling fields a request leaves unset;
        adapters: the LoRA adapters a request's `adapter` may name (None: --enable-lora is off)."""
        self._adapters = adapters
        self._slots = CallSlots(max_concurrent_calls)
        self._tool_settings = tool_settings  # --tool-call-parser, --enable-auto-tool-choice
        self._watchdog = watchdog
        self._tokenizer = admission.tokenizer
        self._chat = chat
        self._sampling_defaults = sampling_defaults
        self._client = admission.client
        self._metrics = metrics
        self._admission = admission

    def Generate(self, request, context) -> generation_pb2.GenerateResponse:
        with self._slots.slot(context):
            return self._generate(request, context)

    def _generate(self, request, context) -> generation_pb2.GenerateResponse:
        timer = self._metrics.start_request(PROTOCOL)
        generation = None
        try:
            generation = self._start(request, context, timer, whole=True)
            with structlog.contextvars.bound_contextvars(request_id=generation.request.request_id):
                usage = None
                for update in generation.run():
                    usage = update.usage or usage
                self._admission.finished(generation, timer, usage)
                context.send_initial_metadata(((REQUEST_ID_METADATA, generation.request.request_id),))
                response = whole_response(generation.request.request_id, generation.states, usage)
                parser = self._tool_parser(generation)
                return response if parser is None else parse_whole(response, parser)
        except Exception as exc:  # every failure becomes a status code
            self._fail(exc, request, context, timer, generation)
        finally:
            if generation is not None:
                self._admission.leave(generation)

    def GenerateStream(self, request, context):
        with self._slots.slot(context):
            yield from self._generate_stream(request, context)

    def _generate_stream(self, request, context):
        timer = self._metrics.start_request(PROTOCOL)
        generation = None
        try:
            generation = self._start(request, context, timer)
            request_id = generation.request.request_id
            with structlog.contextvars.bound_contextvars(request_id=request_id), \
                    self._watch(generation, context) as watch:
                is_first = True
                parser = self._tool_parser(generation)
                calls = StreamedCalls(parser) if parser is not None else None
                for update in generation.run():
                    if update.usage is not None:
                        self._admission.finished(generation, timer, update.usage)
                    if is_first:
                        context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
                        is_first = False
                    with watch.writing():
                        message = stream_message(request_id, update.completions, update.usage)
                        yield message if calls is None else calls.rewrite(message)
        except GeneratorExit:  # the call ended while a message was on its way: the client is gone
            if timer.is_running:
                self._admission.failed(RequestFailed(CANCELLED), timer, generation,
                                       deadline_passed=lambda: _deadline_passed(context), code_of=_code_name)
            raise
        except Exception as exc:  # every failure becomes a status code
            self._fail(exc, request, context, timer, generation)
        finally:
            if generation is not None:
                self._admission.leave(generation)

    def Tokenize(self, request, context) -> generation_pb2.TokenizeResponse:
        with self._slots.slot(context):
            return self._tokenize(request, context)

    def _tokenize(self, request, context) -> generation_pb2.TokenizeResponse:
        if isinstance(request, UndecodableRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            check_text_bytes("text", [request.text], self._admission.max_prompt_bytes())
        except InvalidParameter as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return generation_pb2.TokenizeResponse(token_ids=self._tokenizer.encode(request.text))

    def ModelInfo(self, request, context) -> generation_pb2.ModelInfoResponse:
        with self._slots.slot(context):
            return self._model_info(request, context)

    def _model_info(self, request, context) -> generation_pb2.ModelInfoResponse:
        try:
            info = self._client.get_info()
        except SchedulerError as exc:
            error = classify(exc)
            context.abort(_CODE_OF_KIND[error.kind], error.message)
        return generation_pb2.ModelInfoResponse(
            model_name=info.model_name, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size or self._tokenizer.vocab_size,
            eos_token_ids=self._tokenizer.eos_token_ids, block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks, tensor_parallel_size=info.tensor_parallel_size)

    def _tool_parser(self, generation: Generation) -> str | None:
        """The parser of a request whose output may hold tool calls, else None."""
        tools = generation.request.tools
        return self._tool_settings.parser if tools is not None and tools.is_active else None

    def _watch(self, generation: Generation, context):
        """The stream's write watch: past the write timeout the request is aborted in the scheduler
        (its blocks freed) and the call cancelled."""
        if self._watchdog is None:
            return contextlib.nullcontext(StreamWatch(lambda: None))
        timeout_s = self._watchdog.timeout_s
        request_id = generation.request.request_id

        def on_timeout() -> None:
            log.warning("stream_write_timeout", request_id=request_id, stream_write_timeout=timeout_s)
            generation.cancel()
            context.cancel()

        return self._watchdog.watch(on_timeout)

    def _start(self, request, context, timer: RequestTimer, *, whole: bool = False) -> Generation:
        if isinstance(request, UndecodableRequest):
            raise RequestFailed(RequestError(ErrorKind.INVALID, request.message, "rejected", request.field_name or None))
        limits = self._admission.limits()
        if not request.request_id:
            request.request_id = _metadata_request_id(context)
        adapter = self._adapter(request.adapter) if request.adapter else None
        validated = validate_request(request, self._tokenizer, limits, self._chat, self._tool_settings,
                                     self._sampling_defaults)
        validated.adapter = adapter
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None and remaining < NO_DEADLINE_S else None
        generation = self._admission.start(validated, timer, timeout=timeout, whole=whole)
        context.add_callback(generation.cancel)
        return generation

    def _adapter(self, name: str) -> AdapterRef:
        if self._adapters is None:
            raise UnknownAdapterName(f"adapter {name!r}: this server serves no LoRA adapters (--enable-lora)")
        try:
            return self._adapters.resolve(name)
        except UnknownAdapter:
            served = ", ".join(sorted(spec.name for spec in self._adapters.adapters())) or "none"
            raise UnknownAdapterName(f"no LoRA adapter named {name!r} (served: {served})") from None

    def _fail(self, exc: Exception, request, context, timer: RequestTimer, generation: Generation | None) -> None:
        """Closes the failed request (Admission.failed) and ends the call with its status."""
        request_id = generation.request.request_id if generation is not None else ""
        if not request_id and not isinstance(request, UndecodableRequest):
            request_id = request.request_id
        if request_id and is_printable_ascii(request_id):
            context.set_trailing_metadata(((REQUEST_ID_METADATA, request_id),))
        error = self._admission.failed(exc, timer, generation, request_id=request_id,
                                       deadline_passed=lambda: _deadline_passed(context), code_of=_code_name)
        context.abort(_CODE_OF_KIND[error.kind], error.message)


def _deadline_passed(context) -> bool:
    """Whether a call that ended early ended because its deadline passed (else it was cancelled)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def _metadata_request_id(context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA and isinstance(value, str):
            return value
    return ""


def generation_rpc_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """The service's handlers; requests that do not parse reach the servicer as UndecodableRequest
    (so they end as INVALID_ARGUMENT, where gRPC itself would answer INTERNAL)."""
    pb = generation_pb2
    methods = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, lenient_deserializer(pb.GenerateRequest), pb.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, lenient_deserializer(pb.GenerateRequest), pb.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize, lenient_deserializer(pb.TokenizeRequest), pb.TokenizeResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfo, lenient_deserializer(pb.ModelInfoRequest), pb.ModelInfoResponse.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(GENERATION_SERVICE, methods)
