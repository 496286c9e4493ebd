"""The frontend's Prometheus metrics (names pinned by the public contract) and a per-request timer.

`pagedserve_requests_total{finish_reason}` counts finished requests by the finish reason of their
first completion (`length`, `stop`, `stop_sequence`), plus `abort` (the client cancelled or its
deadline passed), `rejected` (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) and `error` (anything else).
Every metric has a `protocol` label, `grpc` or `http` (the OpenAI-compatible API), the public
surface the request came in on.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from pagedserve.security.metrics_endpoint import serve_metrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
FINISH_LABELS = ("length", "stop", "stop_sequence", "abort", "rejected", "error")
PROTOCOLS = ("grpc", "http")


class FrontendMetrics:
    """Metrics in their own registry, so several frontends can live in one process (tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.time_to_first_token = Histogram(
            "pagedserve_time_to_first_token_seconds", "Time from request arrival to its first token.",
            ["protocol"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "pagedserve_inter_token_latency_seconds", "Time between successive token outputs of a request.",
            ["protocol"], buckets=_ITL_BUCKETS, registry=self.registry)
        self.request_latency = Histogram(
            "pagedserve_request_latency_seconds", "Time from request arrival to its end.",
            ["protocol"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter(
            "pagedserve_requests", "Finished requests by finish reason.", ["finish_reason", "protocol"],
            registry=self.registry)
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens of requests the scheduler accepted.",
            ["protocol"], registry=self.registry)
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Tokens generated and returned to clients.", ["protocol"],
            registry=self.registry)
        for protocol in PROTOCOLS:
            for metric in (self.time_to_first_token, self.inter_token_latency, self.request_latency,
                           self.prompt_tokens, self.generation_tokens):
                metric.labels(protocol=protocol)
            for label in FINISH_LABELS:
                self.requests.labels(finish_reason=label, protocol=protocol)

    def serve(self, port: int, host: str | None = None) -> int:
        """Starts the /metrics HTTP endpoint in a daemon thread (host None: loopback; behind the
        scrape token when one is set: pagedserve.security.metrics_endpoint); returns the bound
        port (0 picks one)."""
        server = serve_metrics(self.registry, port, host)
        self._http_server = server
        return server.server_port

    def stop(self) -> None:
        server = getattr(self, "_http_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()

    def start_request(self, protocol: str) -> RequestTimer:
        """A timer for a request that arrived now over `protocol` ("grpc" or "http")."""
        return RequestTimer(self, protocol)


class RequestTimer:
    """Times one request: first token, gaps between token outputs, whole latency."""

    def __init__(self, metrics: FrontendMetrics, protocol: str) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
        self._metrics = metrics
        self._protocol = protocol
        self._time_to_first_token = metrics.time_to_first_token.labels(protocol=protocol)
        self._inter_token_latency = metrics.inter_token_latency.labels(protocol=protocol)
        self._generation_tokens = metrics.generation_tokens.labels(protocol=protocol)
        self._arrival = time.monotonic()
        self._last_token_time: float | None = None
        self._is_done = False

    def on_accepted(self, num_prompt_tokens: int) -> None:
        self._metrics.prompt_tokens.labels(protocol=self._protocol).inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int, *, is_merged: bool = False) -> None:
        """One scheduler output carried `num_tokens` new tokens (over all completions). is_merged:
        it may merge several steps' outputs (a held request's), so its gap is no inter-token
        latency (the first output of a request still gives its time to first token)."""
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._last_token_time is None:
            self._time_to_first_token.observe(now - self._arrival)
        elif not is_merged:
            self._inter_token_latency.observe(now - self._last_token_time)
        self._last_token_time = now
        self._generation_tokens.inc(num_tokens)

    @property
    def is_running(self) -> bool:
        """Whether the request has not been recorded as ended yet."""
        return not self._is_done

    def on_done(self, finish_label: str) -> None:
        """Records the end of the request once; later calls are ignored."""
        if self._is_done:
            return
        self._is_done = True
        label = finish_label if finish_label in FINISH_LABELS else "error"
        self._metrics.requests.labels(finish_reason=label, protocol=self._protocol).inc()
        self._metrics.request_latency.labels(protocol=self._protocol).observe(time.monotonic() - self._arrival)
