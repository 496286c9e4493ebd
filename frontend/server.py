"""The frontend process: public gRPC server (Generation, health, reflection), the OpenAI-compatible
HTTP API, and Prometheus metrics.

```
 serve_frontend()
   ├─ grpc.server  host:port   pagedserve.v1.Generation   (servicer.py; its own call limit,
   │                                                       slow readers cut: stream_watchdog.py)
   │   plaintext, TLS or mTLS  grpc.health.v1.Health       "" = alive, Generation = scheduler ready
   │   (transport.py)          server reflection           both services listed
   ├─ uvicorn thread           host:http_port (0: none)   /v1/completions, /v1/chat/completions … (http_server.py)
   │                           same TLS settings
   ├─ ReadinessMonitor thread  polls the scheduler's GetInfo (readiness.py); requests whose
   │                           scheduler died wait on it for a restart, then resume (recovery.py)
   └─ /metrics HTTP            host:metrics_port, when a metrics port is given
```

`run_frontend()` is the `pagedserve frontend` entry: it serves until SIGINT or SIGTERM, then
drains (drain.py): readiness NOT_SERVING and new requests UNAVAILABLE at once, running requests
finish for up to the shutdown timeout, whatever is left is cut (UNAVAILABLE, aborted in the
scheduler), and the process exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from pagedserve.checkpoints.generation_defaults import GenerationConfigError, load_sampling_defaults
from pagedserve.checkpoints.resolve import served_model_name
from pagedserve.frontend.generation.admission import Admission
from pagedserve.frontend.tools.tool_templates import family_template
from pagedserve.frontend.tokenization.chat_template import ChatTemplate, ChatTemplateError, read_chat_template
from pagedserve.frontend.generation.drain import InFlight
from pagedserve.frontend.config import FrontendConfig
from pagedserve.frontend.generation.recovery import SchedulerRecovery
from pagedserve.frontend.metrics import FrontendMetrics
from pagedserve.frontend.upstream.readiness import DEFAULT_POLL_INTERVAL_S, GENERATION_SERVICE, ReadinessMonitor
from pagedserve.frontend.grpc.reflection import enable_reflection
from pagedserve.frontend.upstream.replica_set import ReplicaSet, is_dns_name
from pagedserve.frontend.upstream.scheduler_client import SchedulerClient
from pagedserve.frontend.grpc.servicer import GenerationServicer, generation_rpc_handler
from pagedserve.frontend.generation.stream_watchdog import StreamWatchdog
from pagedserve.frontend.tokenization.tokenizer import TokenizerLoadError, load_tokenizer
from pagedserve.frontend.grpc.transport import TransportConfigError
from pagedserve.security.bearer_auth import HEALTH_PREFIX, REFLECTION_PREFIX, BearerTokenInterceptor
from pagedserve.config.grpc_options import DEFAULT_SHUTDOWN_TIMEOUT_S
from pagedserve.log import configure_logging
from pagedserve.adapters.peft_folder import AdapterError
from pagedserve.checkpoints.model_config import ModelConfigError
from pagedserve.frontend.lora.registry import AdapterRegistry
from pagedserve.frontend.openai.config import API_KEY_ENV
from pagedserve.teardown import bound_teardown

if TYPE_CHECKING:
    from pagedserve.frontend.openai.server import HttpServer

STOP_GRACE_S = 5.0
HEALTH_HEADROOM_RPCS = 16  # server call slots beyond --max-concurrent-rpcs: health and reflection
CUT_GRACE_S = 2.0  # after the shutdown timeout: how long cut requests get to send their status


class FrontendStartError(RuntimeError):
    """The frontend could not start (port in use, no tokenizer)."""


class FrontendServer:
    """A running frontend; `port` and `metrics_port` are the bound ports (useful when 0 was asked)."""

    def __init__(self, server: grpc.Server, port: int, metrics: FrontendMetrics, metrics_port: int | None,
                 readiness: ReadinessMonitor, client: SchedulerClient, in_flight: InFlight,
                 http_server: HttpServer | None = None, watchdog: StreamWatchdog | None = None) -> None:
        self.server = server
        self.watchdog = watchdog
        self.port = port
        self.http_server = http_server
        self.http_port = http_server.port if http_server is not None else None
        self.metrics = metrics
        self.metrics_port = metrics_port
        self.readiness = readiness
        self.in_flight = in_flight
        self._client = client

    def drain(self, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> int:
        """Readiness NOT_SERVING and new requests UNAVAILABLE now; running requests get up to
        `shutdown_timeout_s` to finish, the rest are cut; then the server stops. Returns the
        number of requests cut."""
        self.readiness.begin_drain()
        num_cut = self.in_flight.drain(shutdown_timeout_s)
        if num_cut:
            self.in_flight.cut(CUT_GRACE_S)
        self.stop(grace_s=CUT_GRACE_S)
        return num_cut

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """NOT_SERVING everywhere, refuse new calls, wait up to `grace_s` for running ones, then
        cancel the rest (which aborts them in the scheduler)."""
        self.readiness.stop()
        if self.http_server is not None:
            self.http_server.stop(grace_s)
        self.server.stop(grace_s).wait()
        if self.watchdog is not None:
            self.watchdog.stop()
        self._client.close()
        self.metrics.stop()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)


def serve_frontend(config: FrontendConfig, *, health_poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                   frontend_id: str | None = None) -> FrontendServer:
    """Loads the tokenizer of config.model_path, binds config.host:config.port (0 picks a free
    port) and starts serving; returns at once."""
    host, port, transport = config.host, config.port, config.transport
    try:
        tokenizer = load_tokenizer(config.model_path)
        credentials = transport.server_credentials()
        template_file = config.http.chat_template_file
        chat = ChatTemplate(tokenizer, read_chat_template(template_file) if template_file else None,
                            tools_template=family_template(config.tool_call_parser))
        sampling_defaults = load_sampling_defaults(config.generation_config, config.model_path,
                                                   served_model_name(config.model_path))
    except (TokenizerLoadError, TransportConfigError, ChatTemplateError, GenerationConfigError) as exc:
        raise FrontendStartError(str(exc)) from exc
    adapters = _adapter_registry(config)
    frontend_id = frontend_id or f"{socket.gethostname()}:{os.getpid()}"
    metrics = FrontendMetrics()
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    addresses = config.scheduler_addresses
    if len(addresses) == 1 and not is_dns_name(addresses[0]):
        client = SchedulerClient(addresses[0], frontend_id=frontend_id)
        readiness = ReadinessMonitor(client, health_servicer, poll_interval_s=health_poll_interval_s)
    else:  # several replicas, or a DNS name that may resolve to several: the set stands in for both
        client = readiness = ReplicaSet(addresses, health_servicer, frontend_id=frontend_id, routing=config.routing,
                                        poll_interval_s=health_poll_interval_s)
    in_flight = InFlight()
    # one request lifecycle for both protocols: the same drain, readiness and recovery
    admission = Admission(tokenizer, client, readiness, in_flight,
                          SchedulerRecovery(readiness, config.scheduler_recovery_timeout))
    watchdog = StreamWatchdog(config.stream_write_timeout)
    servicer = GenerationServicer(admission, metrics, chat, max_concurrent_calls=config.max_concurrent_rpcs,
                                  watchdog=watchdog, tool_settings=config.tool_settings,
                                  sampling_defaults=sampling_defaults, adapters=adapters)

    # Each streaming call holds a worker thread. The Generation service limits its own calls to
    # max_concurrent_rpcs (RESOURCE_EXHAUSTED beyond); the server takes HEALTH_HEADROOM_RPCS more, so
    # health checks and reflection answer while every Generation slot is taken, and refuses beyond
    # that (so no queue of calls grows without bound under overload).
    max_rpcs = config.max_concurrent_rpcs + HEALTH_HEADROOM_RPCS
    options = [("grpc.max_concurrent_streams", config.max_streams_per_connection), *transport.server_options()]
    pool = futures.ThreadPoolExecutor(max_workers=max_rpcs, thread_name_prefix="rpc")
    api_key = config.http.resolved_api_key()
    interceptors = [BearerTokenInterceptor(api_key, (HEALTH_PREFIX, REFLECTION_PREFIX))] if api_key else []
    server = grpc.server(pool, options=options, maximum_concurrent_rpcs=max_rpcs, interceptors=interceptors)
    server.add_generic_rpc_handlers((generation_rpc_handler(servicer),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection((GENERATION_SERVICE, health.SERVICE_NAME), server)
    try:  # whatever fails to start, the scheduler channel and the metrics endpoint are closed
        bound_port = _listen(server, host, port, credentials)
        bound_metrics_port = _serve_metrics(metrics, config)
        http_server = None
        if config.http.is_enabled:
            from pagedserve.frontend.openai.server import HttpStartError, start_http_server  # FastAPI: only when used

            try:
                http_server = start_http_server(
                    admission, metrics, config.http, chat, host=host,
                    model_path=config.model_path, transport=transport,
                    max_concurrent_requests=config.max_concurrent_rpcs, grace_s=CUT_GRACE_S,
                    stream_write_timeout_s=config.stream_write_timeout,
                    max_undelivered_messages=config.max_undelivered_messages, tool_settings=config.tool_settings,
                    sampling_defaults=sampling_defaults, adapters=adapters,
                    allow_runtime_lora_updating=config.lora.allow_runtime_lora_updating)
            except HttpStartError as exc:
                raise FrontendStartError(str(exc)) from exc
    except FrontendStartError:
        client.close()
        metrics.stop()
        raise
    server.start()
    readiness.start()
    return FrontendServer(server, bound_port, metrics, bound_metrics_port, readiness, client, in_flight,
                          http_server, watchdog)


def _listen(server: grpc.Server, host: str, port: int, credentials) -> int:
    """Binds the public gRPC port (TLS when credentials are given); returns the bound port."""
    try:
        if credentials is None:
            bound_port = server.add_insecure_port(f"{host}:{port}")
        else:
            bound_port = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError as exc:
        raise FrontendStartError(f"cannot listen on {host}:{port}: {exc}") from exc
    if bound_port == 0:
        raise FrontendStartError(f"cannot listen on {host}:{port} (in use?)")
    return bound_port


def _serve_metrics(metrics: FrontendMetrics, config: FrontendConfig) -> int | None:
    """Starts /metrics when a metrics port is given; returns the bound port (None: not served)."""
    if config.metrics_port is None:
        return None
    try:
        return metrics.serve(config.metrics_port, host=config.resolved_metrics_host)
    except OSError as exc:
        raise FrontendStartError(f"cannot serve metrics on {config.resolved_metrics_host}:{config.metrics_port}: "
                                 f"{exc}") from exc


def _adapter_registry(config: FrontendConfig) -> AdapterRegistry | None:
    """The LoRA adapters of --lora-modules, checked against the model (None without --enable-lora)."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    if lora.allow_runtime_lora_updating and not config.http.resolved_api_key():
        raise FrontendStartError("--allow-runtime-lora-updating needs an API key (--api-key or "
                                 f"${API_KEY_ENV}): loading an adapter reads folders on this host")
    base_name = config.http.served_model_name or served_model_name(config.model_path)
    try:
        return AdapterRegistry.for_model(base_name, config.model_path, max_rank=lora.max_lora_rank,
                                         modules=lora.modules)
    except (AdapterError, ModelConfigError) as exc:
        raise FrontendStartError(f"--lora-modules: {exc}") from exc


def run_frontend(config: FrontendConfig) -> int:
    """`pagedserve frontend`: serves until SIGINT/SIGTERM, then drains. Returns the exit code."""
    process_log = configure_logging("frontend")
    stop_requested = threading.Event()

    def request_stop(signum, _frame) -> None:
        process_log.info("frontend_stopping", signal=signal.Signals(signum).name)
        stop_requested.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            frontend = serve_frontend(config)
        except FrontendStartError as exc:
            process_log.error("frontend_start_failed", error=str(exc))
            return 1
        transport = config.transport
        tls = "mutual" if transport.is_mutual_tls else "on" if transport.is_tls else "off"
        process_log.info("frontend_serving", address=f"{config.host}:{frontend.port}",
                         http_port=frontend.http_port, scheduler=config.scheduler_address,
                         metrics_port=frontend.metrics_port,
                         scheduler_recovery_timeout=config.scheduler_recovery_timeout,
                         model=config.model_path, tls=tls)
        while not stop_requested.wait(0.5):
            pass
        process_log.info("frontend_draining", num_in_flight=len(frontend.in_flight),
                         shutdown_timeout=config.shutdown_timeout)
        num_cut = frontend.drain(config.shutdown_timeout)
        process_log.info("frontend_stopped", num_requests_cut=num_cut)
        bound_teardown()  # the interpreter's teardown follows: pagedserve/teardown.py
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
