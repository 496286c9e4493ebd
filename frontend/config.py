"""Validated configuration of the frontend process: its public port, the scheduler it talks to,
its limits, its transport (message size, keepalive, TLS) and its OpenAI-compatible HTTP port.

The one definition of `pagedserve frontend`'s settings; the flags (and what `serve` forwards)
are derived from the fields' metadata (pagedserve.config.flags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.config.flags import nested, option, require
from pagedserve.frontend.lora.config import LoraFrontendConfig
from pagedserve.frontend.openai.config import HttpConfig
from pagedserve.frontend.upstream.router import ROUTING_POLICIES
from pagedserve.frontend.tools.tool_parsers import PARSERS
from pagedserve.frontend.tools.tool_request import ToolSettings
from pagedserve.frontend.generation.stream_watchdog import DEFAULT_STREAM_WRITE_TIMEOUT_S
from pagedserve.frontend.grpc.transport import TransportConfig
from pagedserve.config.shared_options import (
    DEFAULT_HOST, DEFAULT_METRICS_HOST, DEFAULT_PORT, DEFAULT_SCHEDULER_PORT, metrics_host_option, model_option, shutdown_timeout_option,
)

DEFAULT_MAX_CONCURRENT_RPCS = 512
DEFAULT_MAX_STREAMS_PER_CONNECTION = 128
DEFAULT_SCHEDULER_RECOVERY_TIMEOUT_S = 60.0
DEFAULT_MAX_UNDELIVERED_MESSAGES = 4096  # per HTTP stream; a few MB at most


@dataclass(kw_only=True, slots=True)
class FrontendConfig:
    model_path: str = model_option()  # the frontend reads only the tokenizer and EOS ids
    host: str = option(DEFAULT_HOST, serve=True, help="address of the public gRPC and HTTP ports (and of /metrics unless --metrics-host)")
    port: int = option(DEFAULT_PORT, serve=True, help="public gRPC port (0: a free one)")
    scheduler_address: str = option(
        f"{DEFAULT_HOST}:{DEFAULT_SCHEDULER_PORT}", metavar="HOST:PORT", is_repeatable=True,
        help="a scheduler's internal gRPC port; repeat it (or give one DNS name with several addresses) "
             "for several replicas, each request then goes to one of them (see --routing)")
    routing: str = option(ROUTING_POLICIES[0], choices=ROUTING_POLICIES, serve=True,
                          help="with several replicas: prefix (the replica whose prefix cache most likely "
                               "holds the prompt's leading blocks, unless load is imbalanced) or round-robin")
    metrics_port: int | None = option(None, metavar="P", serve=True, help="serve Prometheus /metrics on this port")
    metrics_host: str | None = metrics_host_option()
    shutdown_timeout: float = shutdown_timeout_option()
    max_concurrent_rpcs: int = option(
        DEFAULT_MAX_CONCURRENT_RPCS, metavar="N", serve=True,
        help="calls of the Generation service at once (health checks and reflection apart: they always "
             "answer); beyond it RESOURCE_EXHAUSTED; HTTP: prompts generating at once, beyond it 429")
    max_streams_per_connection: int = option(
        DEFAULT_MAX_STREAMS_PER_CONNECTION, metavar="N", serve=True,
        help="calls at once on one client connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); more wait "
             "in the client")
    stream_write_timeout: float = option(
        DEFAULT_STREAM_WRITE_TIMEOUT_S, metavar="S", serve=True,
        help="a stream (gRPC GenerateStream, HTTP SSE) whose client has not taken a message for this long "
             "is aborted (its blocks freed) and its call cancelled (HTTP: its connection closed)")
    max_undelivered_messages: int = option(
        DEFAULT_MAX_UNDELIVERED_MESSAGES, metavar="N", serve=True,
        help="updates of one HTTP stream waiting for a client that is not reading, beyond which the request "
             "is aborted (its blocks freed; 429 in the stream). gRPC streams hold at most one: the frontend "
             "reads the scheduler only as the client takes messages")
    scheduler_recovery_timeout: float = option(
        DEFAULT_SCHEDULER_RECOVERY_TIMEOUT_S, metavar="S", serve=True,
        help="when the scheduler dies mid-request: how long the request waits for a restarted scheduler, "
             "then goes on from the tokens already streamed; past it, or with 0, it fails with UNAVAILABLE")
    tool_call_parser: str | None = option(
        None, metavar="NAME", serve=True, choices=tuple(sorted(PARSERS)),
        help="parse tool calls out of chat outputs in this model format (hermes, llama3_json, smollm2); "
             "needed for tools with tool_choice other than none; smollm2 also brings a tool-aware chat "
             "template for SmolLM2 checkpoints, whose own template has none")
    enable_auto_tool_choice: bool = option(
        False, serve=True, help='serve tool_choice "auto" (the default with tools): the model decides whether '
                                "to call a tool (needs --tool-call-parser)")
    generation_config: str = option(
        "auto", metavar="auto|vllm|FOLDER", serve=True,
        help="sampling defaults for the fields a request leaves out (HTTP and gRPC): auto, the model's own "
             "(generation_config.json, GGUF metadata, or a known model's published ones); vllm, the neutral "
             "ones (HTTP temperature 1, gRPC greedy); FOLDER, FOLDER/generation_config.json")
    transport: TransportConfig = nested(TransportConfig, title="public port transport")
    http: HttpConfig = nested(HttpConfig, title="OpenAI-compatible HTTP")
    lora: LoraFrontendConfig = nested(LoraFrontendConfig, title="LoRA adapters")

    @property
    def tool_settings(self) -> ToolSettings:
        return ToolSettings(self.tool_call_parser, self.enable_auto_tool_choice)

    @property
    def resolved_metrics_host(self) -> str:
        return self.metrics_host or DEFAULT_METRICS_HOST

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            require(value is None or 0 <= value <= 65535, name, f"must be a port number (0-65535), not {value}")
        require(self.shutdown_timeout >= 0, "shutdown_timeout", "must be >= 0")
        require(self.scheduler_recovery_timeout >= 0, "scheduler_recovery_timeout", "must be >= 0 (0: no recovery)")
        require(self.max_concurrent_rpcs >= 1, "max_concurrent_rpcs", "must be >= 1")
        require(all(self.scheduler_addresses), "scheduler_address", "must not be empty")
        require(self.routing in ROUTING_POLICIES, "routing", f"must be one of {', '.join(ROUTING_POLICIES)}")
        require(self.max_streams_per_connection >= 1, "max_streams_per_connection", "must be >= 1")
        require(not self.enable_auto_tool_choice or self.tool_call_parser is not None, "enable_auto_tool_choice",
                "--enable-auto-tool-choice needs --tool-call-parser NAME")
        require(math.isfinite(self.stream_write_timeout) and self.stream_write_timeout > 0, "stream_write_timeout",
                "must be > 0")
        require(self.max_undelivered_messages >= 1, "max_undelivered_messages", "must be >= 1")
        require(bool(self.generation_config.strip()), "generation_config", "must be auto, vllm or a folder")

    @property
    def scheduler_addresses(self) -> list[str]:
        """Each --scheduler-address given (HOST:PORT; a host may be a DNS name of several replicas)."""
        return [address.strip() for address in self.scheduler_address.split(",")]
