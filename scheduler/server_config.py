"""Validated configuration of the scheduler process: its ports, its worker link and its engine.

The one definition of `pagedserve scheduler`'s settings; the flags (and what `serve` forwards)
are derived from the fields' metadata (pagedserve.config.flags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.config.flags import nested, option, require
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.undelivered_output import DEFAULT_MAX_UNDELIVERED_BYTES
from pagedserve.config.shared_options import (
    DEFAULT_HOST, DEFAULT_METRICS_HOST, DEFAULT_SCHEDULER_PORT, allow_insecure_internal_transport_option, metrics_host_option, model_option, plan_address_option, result_address_option,
    shutdown_timeout_option, tensor_parallel_size_option,
)


@dataclass(kw_only=True, slots=True)
class SchedulerServerConfig:
    model_path: str = model_option()
    host: str = option(DEFAULT_HOST, help="address of the internal gRPC port")
    port: int = option(DEFAULT_SCHEDULER_PORT, help="internal gRPC port, which frontends connect to")
    plan_address: str = plan_address_option()
    result_address: str = result_address_option()
    allow_insecure_internal_transport: bool = allow_insecure_internal_transport_option()
    tensor_parallel_size: int = tensor_parallel_size_option()
    metrics_port: int | None = option(None, metavar="P", help="serve Prometheus /metrics on this port")
    metrics_host: str | None = metrics_host_option()
    heartbeat_timeout: float = option(10.0, metavar="SECONDS", serve=True,
                                      help="a worker rank not heard from this long is lost")
    shutdown_timeout: float = shutdown_timeout_option()
    max_undelivered_bytes: int = option(
        DEFAULT_MAX_UNDELIVERED_BYTES, metavar="BYTES", serve=True,
        help="output of one request its frontend has not read yet (encoded), beyond which the request is "
             "aborted (its blocks freed) and its internal stream ends with RESOURCE_EXHAUSTED")
    engine: SchedulerConfig = nested(SchedulerConfig, title="scheduling")

    @property
    def resolved_metrics_host(self) -> str:
        return self.metrics_host or DEFAULT_METRICS_HOST

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            require(value is None or 0 <= value <= 65535, name, f"must be a port number (0-65535), not {value}")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        require(math.isfinite(self.heartbeat_timeout) and self.heartbeat_timeout > 0, "heartbeat_timeout",
                "must be > 0")
        require(self.shutdown_timeout >= 0, "shutdown_timeout", "must be >= 0")
        require(self.max_undelivered_bytes >= 1, "max_undelivered_bytes", "must be >= 1")
