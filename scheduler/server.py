"""The scheduler's internal gRPC service (frontend -> scheduler), served with grpc.aio.

Each Submit is one server stream: the engine's loop thread hands each step's outputs to the
event loop in one batch (loop_dispatch), and every stream sends what its request got, one message
per step. A stream that closes before its request finished aborts the request in the
engine, which frees its blocks before the next step: a client that cancels, a deadline that
passes (the frontend forwards it as the Submit deadline), and a frontend that dies (its TCP
connection closes; server keepalive pings find one whose host vanished) all end that way.
A frontend that keeps the stream open but stops reading it is bounded too: past
--max-undelivered-bytes of unread output the request is aborted and its stream ends with
RESOURCE_EXHAUSTED (scheduler/undelivered_output.py).

A Session carries many requests on one stream, each with that same contract; a frontend keeps one
per scheduler (GetInfo's has_session says it is served), and a step's outputs for all its requests
go out in one message (session.py).

A Submit that carries continuations is a request resubmitted by a frontend after the scheduler
that ran it was lost: each completion goes on from the tokens the client already has
(request_intake.py). GetInfo's instance_id, new at every start, lets a frontend whose streams
broke tell a restarted scheduler (resubmit) from this one ending them on purpose (a final status).

Drain (SIGTERM/SIGINT):

    draining ── GetInfo says not ready (frontends turn NOT_SERVING), new requests: UNAVAILABLE
       │        open requests run to the end, up to shutdown_timeout
       ▼
    engine stop ── requests still open end with UNAVAILABLE (and are aborted),
                   workers are told to shut down; then the server closes
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from dataclasses import replace
from functools import partial

import grpc
import structlog

from pagedserve.security.bearer_auth import AioBearerTokenInterceptor
from pagedserve.config.grpc_options import INTERNAL_SERVER_OPTIONS
from pagedserve.security.internal_token import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV, internal_token
from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.log import configure_logging
from pagedserve.checkpoints.model_config import ModelInfo, load_model_info
from pagedserve.contracts.request_types import Request, RequestOutput
from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.scheduler.core.admission import QueueFull
from pagedserve.scheduler.engine import Engine, EngineUnavailable
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.server_config import SchedulerServerConfig
from pagedserve.scheduler.session import DEADLINE_SLACK_S, SessionStream
from pagedserve.scheduler.undelivered_output import DEFAULT_MAX_UNDELIVERED_BYTES, OutputOverflow, UndeliveredOutput
from pagedserve.scheduler.worker_link import WorkerLink
from pagedserve.contracts.scheduler_codec import request_from_proto
from pagedserve.scheduler.structured_output.compiler import GrammarCompiler
from pagedserve.scheduler.structured_output.vocabulary import load_vocabulary
from pagedserve.security.zmq_curve import check_internal_transport, curve_keys_from_env
from pagedserve.teardown import bound_teardown

DRAIN_POLL_S = 0.05


_REJECT_REASON = {grpc.StatusCode.INVALID_ARGUMENT: "invalid", grpc.StatusCode.RESOURCE_EXHAUSTED: "queue_full",
                  grpc.StatusCode.UNAVAILABLE: "unavailable"}


def _status_for(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, OutputOverflow):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (InvalidParameter, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _continued(request: Request) -> dict:
    """Log fields of a resubmitted request: the tokens it continues from, per index."""
    if not request.continuations:
        return {}
    return {"continued_tokens": {c.index: len(c.token_ids) for c in request.continuations},
            "num_finished_before": sum(c.is_finished for c in request.continuations)}


def check_submitted(request: Request, vocab_size: int) -> None:
    """The scheduler does not take a frontend's word for it: every token id (prompt and
    continuations) must be in the vocabulary and the parameters in range, else InvalidParameter
    (an id past the vocabulary would crash the workers' embedding lookup)."""
    if vocab_size > 0:
        request.sampling.validate(vocab_size=vocab_size)
    else:
        request.sampling.validate()
    token_lists = [("prompt_token_ids", request.prompt_token_ids)]
    token_lists += [(f"continuations[{c.index}].token_ids", c.token_ids) for c in request.continuations]
    for field_name, token_ids in token_lists if vocab_size > 0 else ():
        for position, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidParameter(field_name, f"token id {token_id} at position {position} is outside "
                                                   f"the vocabulary (size {vocab_size})")


def _close_reason(context) -> str:
    remaining = context.time_remaining()
    return "deadline_exceeded" if remaining is not None and remaining <= DEADLINE_SLACK_S else "stream_closed"


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine, model: ModelInfo, tensor_parallel_size: int,
                 metrics: SchedulerMetrics | None = None,
                 max_undelivered_bytes: int = DEFAULT_MAX_UNDELIVERED_BYTES,
                 grammars: GrammarCompiler | None = None) -> None:
        self.engine = engine
        self.max_undelivered_bytes = max_undelivered_bytes
        self.grammars = grammars
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size
        self.metrics = metrics or SchedulerMetrics()
        self.is_draining = False
        self.num_open_streams = 0  # requests not yet ended (event loop only: no lock)
        self.sessions: set[SessionStream] = set()
        self.instance_id = uuid.uuid4().hex  # GetInfo's: a restart is a new instance
        self._log = structlog.get_logger()

    async def drain(self, timeout: float) -> int:
        """Refuses new Submits and waits up to `timeout` for open streams; returns those left."""
        self.is_draining = True
        deadline = time.monotonic() + timeout
        while self.num_open_streams and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return self.num_open_streams

    def rejected(self, log, exc: Exception) -> grpc.StatusCode:
        """Counts and logs a request refused with `exc`; returns the status it ends with."""
        code = _status_for(exc)
        self.metrics.requests_rejected.labels(reason=_REJECT_REASON.get(code, "invalid")).inc()
        log.info("request_rejected", code=code.name, error=str(exc))
        return code

    async def _refuse(self, context, log, exc: Exception) -> None:
        await context.abort(self.rejected(log, exc), str(exc))

    # for the Session stream (session.py)
    status_for = staticmethod(_status_for)
    continued = staticmethod(_continued)

    @property
    def log(self):
        return self._log

    def check_submitted(self, request: Request) -> None:
        check_submitted(request, self.model.vocab_size)

    async def Session(self, request_iterator, context):
        session = SessionStream(self, request_iterator, context)
        self.sessions.add(session)
        try:
            async for response in session.responses():
                yield response
        finally:
            self.sessions.discard(session)

    async def close_sessions(self, timeout: float) -> None:
        """Ends every Session stream (after the engine stopped: their requests have ended), waiting up
        to `timeout` for them to send what they hold."""
        for session in list(self.sessions):
            session.close()
        deadline = time.monotonic() + timeout
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    async def Submit(self, request, context):
        log = self._log.bind(request_id=request.request_id, frontend_id=request.frontend_id)
        if self.is_draining:
            self.metrics.requests_rejected.labels(reason="draining").inc()
            log.info("request_rejected", code="UNAVAILABLE", error="draining")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is draining; retry on another replica")
        def on_overflow() -> None:
            self.engine.abort(request.request_id)
            log.warning("request_aborted", reason="undelivered_output_cap", max_bytes=self.max_undelivered_bytes)

        internal = request_from_proto(request, self.model.eos_token_ids)
        # beam search sends its completions once, whole, at the end: nothing to merge
        outputs = UndeliveredOutput(self.max_undelivered_bytes, on_overflow,
                                    hold=internal.hold_output and not internal.sampling.is_beam_search)
        try:
            check_submitted(internal, self.model.vocab_size)
            constraint = internal.sampling.constraint
            if constraint is not None and self.grammars is not None:
                await self.grammars.compile_async(constraint)  # off the step loop, bounded in time
            self.engine.submit(internal, outputs.put)  # called on this event loop (see loop_dispatch)
        except Exception as exc:
            await self._refuse(context, log, exc)
        log.info("request_submitted", prompt_tokens=len(internal.prompt_token_ids),
                 max_tokens=internal.sampling.max_tokens, num_completions=internal.sampling.num_completions,
                 via="submit", **_continued(internal))
        self.num_open_streams += 1
        is_finished = is_started = has_failed = False
        finish_reasons: dict[int, str] = {}
        num_messages = 0  # sent on the stream (a held request's are few: UndeliveredOutput)
        try:
            while not is_finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    is_finished = has_failed = True
                    if not is_started and not isinstance(item, OutputOverflow):  # refused, or no workers
                        await self._refuse(context, log, item)
                    log.warning("request_failed", error=str(item))
                    await context.abort(_status_for(item), str(item))
                is_started = True
                output: RequestOutput = item.output
                is_finished = output.is_finished
                for delta in output.deltas:
                    if delta.finish_reason is not None:
                        finish_reasons[delta.index] = delta.finish_reason.value
                num_messages += 1
                yield item.message
        finally:
            self.num_open_streams -= 1
            if not is_finished:
                self.engine.abort(request.request_id)
                log.info("request_aborted", reason=_close_reason(context))
            elif not has_failed:  # here, not after the loop: a client that closes the stream once it has
                # the last message may end this generator at that yield
                log.info("request_finished", finish_reasons=[finish_reasons[i] for i in sorted(finish_reasons)],
                         num_messages=num_messages)

    async def FinishCompletion(self, request, context):
        self.engine.finish_completion(request.request_id, request.index)
        return scheduler_pb2.FinishCompletionResponse()

    async def GetInfo(self, request, context):
        state = self.engine.state
        config = self.engine.config
        return scheduler_pb2.SchedulerInfo(
            is_ready=state.is_ready and not self.is_draining,
            model_name=self.model.name,
            max_model_len=config.max_model_len,
            vocab_size=self.model.vocab_size,
            block_size=config.block_size,
            num_kv_blocks=state.num_gpu_blocks,
            num_cpu_blocks=state.num_cpu_blocks,
            tensor_parallel_size=self.tensor_parallel_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            instance_id=self.instance_id,
            has_session=True,
        )

    async def GetStats(self, request, context):
        try:
            stats, is_consistent = await asyncio.to_thread(self.engine.call, self._collect_stats)
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        msg = scheduler_pb2.SchedulerStats(is_pool_consistent=is_consistent)
        if stats is not None:
            for name in ("num_running", "num_waiting", "num_swapped", "num_steps",
                         "num_preemptions_swap", "num_preemptions_recompute",
                         "num_prefix_cache_queries", "num_prefix_cache_hits"):
                setattr(msg, name, getattr(stats, name))
            for device, pool in (("gpu", stats.gpu), ("cpu", stats.cpu)):
                for field in ("total", "free", "used", "cached"):
                    setattr(msg, f"num_{device}_blocks_{field}", getattr(pool, f"num_{field}"))
        recent = list(self.engine.state.recent_steps)
        if request.max_recent_steps:
            recent = recent[-request.max_recent_steps:]
        for record in recent:
            msg.recent_steps.add(step_id=record.step_id, request_ids=record.request_ids,
                                 num_prefill_tokens=record.num_prefill_tokens,
                                 num_decode_tokens=record.num_decode_tokens, seconds=record.seconds,
                                 forward_seconds=record.forward_seconds)
        return msg

    def _collect_stats(self):
        scheduler = self.engine.scheduler
        if scheduler is None:
            return None, True
        try:
            scheduler.check_invariants()
            is_consistent = True
        except Exception:
            is_consistent = False
        return scheduler.stats(), is_consistent


def loop_dispatch(loop: asyncio.AbstractEventLoop):
    """The engine's dispatch for sinks that live on `loop`: each step's outputs cross to the loop
    in one call (one wake-up), where every sink runs in turn."""

    def run(pairs) -> None:
        for sink, item in pairs:
            sink(item)

    def dispatch(pairs) -> None:
        try:
            loop.call_soon_threadsafe(run, pairs)
        except RuntimeError:  # the loop has closed: nobody is left to read these
            pass

    return dispatch


async def _serve(config: SchedulerServerConfig, engine_config: SchedulerConfig, model: ModelInfo) -> int:
    log = configure_logging("scheduler")
    token = internal_token()
    interceptors = [AioBearerTokenInterceptor(token, what="the internal token")] if token else []
    if token is None:
        log.warning("internal_port_unauthenticated",
                    hint=f"set {INTERNAL_TOKEN_ENV} or {INTERNAL_TOKEN_FILE_ENV} (serve sets one for its children)")
    server = grpc.aio.server(options=INTERNAL_SERVER_OPTIONS, interceptors=interceptors)
    try:  # first: a port in use ends the start before the worker link or the metrics bind theirs
        bound = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as exc:
        log.error("scheduler_cannot_listen", address=f"{config.host}:{config.port}", error=str(exc))
        return 1
    metrics = SchedulerMetrics()
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.resolved_metrics_host)

    def on_step(engine: Engine, record) -> None:
        if record is None:  # a new scheduler: its pool size is known, its totals start at 0
            metrics.reset_totals()
            metrics.update(engine.scheduler.stats(), None)
            return
        metrics.update(engine.scheduler.stats(), record.seconds, record.queue_seconds)

    def on_idle(engine: Engine) -> None:
        if engine.scheduler is None:  # workers not ready yet, or recovery abandoned
            metrics.clear_gauges(engine.state.num_gpu_blocks)
        else:
            metrics.update(engine.scheduler.stats(), None)

    link = WorkerLink(config.plan_address, config.result_address, config.tensor_parallel_size,
                      heartbeat_timeout=config.heartbeat_timeout)
    grammars = GrammarCompiler(partial(load_vocabulary, config.model_path, model.vocab_size,
                                       list(model.eos_token_ids)))
    threading.Thread(target=_warm_up, args=(grammars, log), name="grammar-vocabulary", daemon=True).start()
    engine = Engine(engine_config, link, on_step=on_step, dispatch=loop_dispatch(asyncio.get_running_loop()),
                    on_idle=on_idle, grammars=grammars)
    engine.start()
    servicer = SchedulerServicer(engine, model, config.tensor_parallel_size, metrics,
                                 max_undelivered_bytes=config.max_undelivered_bytes, grammars=grammars)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the line that says it listens
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    log.info("scheduler_listening", address=f"{config.host}:{bound}",
             plan_address=config.plan_address, result_address=config.result_address)
    await stop.wait()
    log.info("scheduler_draining", num_open_streams=servicer.num_open_streams,
             shutdown_timeout=config.shutdown_timeout)
    num_left = await servicer.drain(config.shutdown_timeout)
    log.info("scheduler_stopping", num_streams_cut=num_left)
    await asyncio.to_thread(engine.stop)  # open requests end with UNAVAILABLE
    await servicer.close_sessions(timeout=2.0)
    await server.stop(grace=2.0)
    link.close()
    log.info("scheduler_stopped")
    bound_teardown()  # asyncio.run's and the interpreter's teardown follow: pagedserve/teardown.py
    return 0


def _warm_up(grammars: GrammarCompiler, log) -> None:
    """Reads the vocabulary for structured output at start; a failure is only logged (constrained
    requests are then refused with the reason)."""
    try:
        grammars.warm_up()
    except Exception as exc:
        log.warning("structured_output_unavailable", error=f"{type(exc).__name__}: {exc}")


def run_scheduler(config: SchedulerServerConfig) -> int:
    """`pagedserve scheduler`: serves until SIGINT/SIGTERM, then drains. max_model_len defaults to,
    and is capped at, the model's max_position_embeddings. A tcp:// worker link without CURVE keys
    is a CurveKeyError (exit 2) unless --allow-insecure-internal-transport."""
    check_internal_transport((config.plan_address, config.result_address), curve_keys_from_env(),
                             is_insecure_allowed=config.allow_insecure_internal_transport)
    model = load_model_info(config.model_path)
    longest = model.max_position_embeddings
    engine_config = replace(config.engine, max_model_len=min(config.engine.max_model_len or longest, longest))
    return asyncio.run(_serve(config, engine_config, model))
