"""The HTTP port of the frontend: uvicorn serving http_app's API on a thread of its own.

```
 frontend process
   ├─ gRPC server threads          pagedserve.v1.Generation (servicer.py)
   ├─ "http" thread                uvicorn event loop: parse, answer, stream SSE
   │     └─ "http-gen-*" threads   prepare (tokenize, chat template) and pump each Generation
   └─ readiness, metrics           shared by both protocols
```

The event loop never blocks on the scheduler: tokenizing and each request's scheduler stream run
on the http-gen pool, so a slow client or a long prompt does not hold other HTTP requests back,
and the gRPC threads only share the interpreter with it. The socket is bound before the thread
starts, so a port in use is a start error; TLS uses the gRPC port's certificate and key (and its
client CA for mutual TLS).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn

from pagedserve.checkpoints.generation_defaults import NEUTRAL, SamplingDefaults
from pagedserve.checkpoints.resolve import served_model_name
from pagedserve.frontend.lora.registry import AdapterRegistry
from pagedserve.frontend.generation.admission import Admission
from pagedserve.frontend.tokenization.chat_template import ChatTemplate
from pagedserve.frontend.openai.app import build_app
from pagedserve.frontend.openai.connection_abort import expose_transport
from pagedserve.frontend.openai.config import HttpConfig
from pagedserve.frontend.metrics import FrontendMetrics
from pagedserve.frontend.openai.serving import ConcurrencyLimit, OpenAIServing
from pagedserve.frontend.grpc.transport import TransportConfig
from pagedserve.frontend.tools.tool_request import ToolSettings

START_TIMEOUT_S = 30.0
EXTRA_THREADS = 8  # prepare steps and /tokenize beside the pumps


class HttpStartError(RuntimeError):
    """The HTTP port could not be opened (in use, bad certificate)."""


class HttpServer:
    """A running HTTP port; `port` is the bound port."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, port: int,
                 executor: ThreadPoolExecutor) -> None:
        self._server = server
        self._thread = thread
        self.port = port
        self._executor = executor

    def stop(self, grace_s: float) -> None:
        """Closes the port; open connections get `grace_s` to finish (streams are cut by the drain
        before this is called)."""
        self._server.should_exit = True
        self._thread.join(grace_s + 5.0)
        self._executor.shutdown(wait=False, cancel_futures=True)


def start_http_server(admission: Admission, metrics: FrontendMetrics, config: HttpConfig,
                      chat_template: ChatTemplate, *, host: str, model_path: str | Path,
                      transport: TransportConfig, max_concurrent_requests: int, grace_s: float,
                      stream_write_timeout_s: float, max_undelivered_messages: int | None,
                      tool_settings: ToolSettings = ToolSettings(),
                      sampling_defaults: SamplingDefaults = NEUTRAL,
                      adapters: AdapterRegistry | None = None, allow_runtime_lora_updating: bool = False) -> HttpServer:
    """Binds host:config.port and serves the OpenAI-compatible API; returns once it accepts."""
    executor = ThreadPoolExecutor(max_workers=max_concurrent_requests + EXTRA_THREADS, thread_name_prefix="http-gen")
    serving = OpenAIServing(admission, metrics, chat_template, config.served_model_name or served_model_name(model_path),
                            executor, ConcurrencyLimit(max_concurrent_requests),
                            stream_write_timeout_s=stream_write_timeout_s,
                            max_undelivered_messages=max_undelivered_messages, tool_settings=tool_settings,
                            sampling_defaults=sampling_defaults, adapters=adapters)
    app = build_app(admission, serving, executor, api_key=config.resolved_api_key(),
                    max_request_bytes=config.max_request_bytes,
                    allow_runtime_lora_updating=allow_runtime_lora_updating)
    uvicorn_config = uvicorn.Config(
        expose_transport(app), log_config=None, access_log=False, lifespan="off", server_header=False,
        timeout_graceful_shutdown=max(1, int(grace_s)),
        ssl_certfile=transport.tls_cert_file, ssl_keyfile=transport.tls_key_file,
        ssl_ca_certs=transport.tls_client_ca_file,
        ssl_cert_reqs=ssl.CERT_REQUIRED if transport.is_mutual_tls else ssl.CERT_NONE)
    try:
        uvicorn_config.load()  # TLS files are read here, so a bad one is a start error
        sock = _bind(host, config.port)
    except (OSError, ssl.SSLError) as exc:
        executor.shutdown(wait=False)
        raise HttpStartError(f"cannot serve HTTP on {host}:{config.port}: {exc}") from exc
    server = uvicorn.Server(uvicorn_config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            executor.shutdown(wait=False)
            raise HttpStartError(f"the HTTP server on {host}:{config.port} did not start")
        time.sleep(0.01)
    return HttpServer(server, thread, sock.getsockname()[1], executor)


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT, not a live listener
        sock.bind(address)
        sock.set_inheritable(False)
    except OSError:
        sock.close()
        raise
    return sock
