"""What `pagedserve serve` starts: each child's validated config, and the command line it gets.

`serve` takes its own options (ServeOptions) and every option of the three processes marked
`serve=True` (pagedserve.config.flags); each flag is added once, so `--model` or
`--shutdown-timeout` set every process that has it. ServeConfig.from_args builds the children's
configs from those flags plus what `serve` decides itself:

    scheduler  --port (--scheduler-port, else a free port), --plan-address/--result-address
               (free local ports), --metrics-port (--scheduler-metrics-port, else --metrics-port + 1),
               --worker-recovery-timeout 120 when --max-worker-restarts > 0 (longer than the
               longest restart back-off, 30 s, plus a model load)
    worker r   --rank r, the same plan/result addresses, --dist-init-address (a free local port),
               --num-threads threads_per_rank(N) unless OMP_NUM_THREADS is set, --speculative-model
               resolved once (as --model is) with its --speculative-quantization; serve refuses
               --speculative-method draft without --speculative-model and --speculative-model
               with any other method (check_draft_flags)
    frontend   --scheduler-address 127.0.0.1:PORT

With --data-parallel-size N > 1, serve starts N replicas and one frontend over all of them:

    replica i  `serve --replica-index i` with the same flags: one scheduler (port --scheduler-port + i,
               else a free port; metrics --scheduler-metrics-port + i when set) and its TP worker
               ranks (their own ZeroMQ ports; threads_per_rank(N * TP): the cores are split between
               every rank of every replica); it restarts its own scheduler and workers, no frontend
    frontend   --scheduler-address of each replica

and each child's argv is derived from its config (to_argv), so it parses back to the same values.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.config.flags import add_flags, flags_of, from_args, option, require, to_argv
from pagedserve.frontend.config import FrontendConfig
from pagedserve.checkpoints.resolve import resolve_model
from pagedserve.launch.restart_policy import DEFAULT_MAX_RESTARTS, DEFAULT_RESET_AFTER_S, RestartPolicy
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.server_config import SchedulerServerConfig
from pagedserve.launch.serve_preflight import Deployment
from pagedserve.config.shared_options import DEFAULT_HOST
from pagedserve.worker.config import WorkerConfig

WORKER_RECOVERY_SECONDS = 120.0  # the scheduler holds requests this long for restarted workers


_handed_out_ports: set[int] = set()
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_FREE_PORT = 10000  # free_port's ports below the ephemeral range start here
FREE_PORT_TRIES = 200
PORT_RANGE_ENV = "PAGEDSERVE_PORT_RANGE"  # "LOW-HIGH": free_port's ports come from this range only


def ephemeral_port_range() -> tuple[int, int] | None:
    """The range the system takes outgoing connections' local ports from (Linux), or None."""
    try:
        low, high = (int(value) for value in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def configured_port_range() -> tuple[int, int] | None:
    """$PAGEDSERVE_PORT_RANGE as (low, high), both included, or None where it is unset. Processes
    that pick ports side by side without knowing of each other (two test processes, two
    deployments on one host) each get their own range, so that a port one of them picked and has
    not bound yet cannot be picked by the other; children inherit it."""
    value = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not value:
        return None
    try:
        low, high = (int(part) for part in value.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH, e.g. 20000-20999") from None
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected 1 <= LOW <= HIGH <= 65535")
    return low, high


def reserve_ports(*ports: int | None) -> None:
    """Ports a deployment names itself, which free_port never hands out in this process: `serve`
    picks its children's ZeroMQ ports while the ports its caller chose (a test harness, an
    operator's script: free ports then, not yet bound) wait for their processes to bind them."""
    _handed_out_ports.update(port for port in ports if port)


def free_port(host: str = DEFAULT_HOST) -> int:
    """A port free now, never one this process handed out before: the system may give a port
    that was just probed and closed again, and two addresses of one deployment (plan and result
    sockets) on one port fail to bind. With $PAGEDSERVE_PORT_RANGE set, the port comes from that
    range. Otherwise, where the system says which range its outgoing connections take their local
    ports from, the port is drawn below it: a port from that range can become the local end of
    some connection before the process it was given to binds it (a frontend then failed to listen
    on its port at every restart)."""
    configured = configured_port_range()
    if configured is not None:
        low, high = configured
        drawn = (random.randint(low, high) for _ in range(FREE_PORT_TRIES))
        port = _first_free(host, itertools.chain(drawn, range(low, high + 1)))  # then every port, in order
        if port is None:
            raise RuntimeError(f"no free port in {PORT_RANGE_ENV}={low}-{high}")
        return port
    span = ephemeral_port_range()
    if span is not None and span[0] > LOWEST_FREE_PORT + FREE_PORT_TRIES:
        port = _first_free(host, (random.randrange(LOWEST_FREE_PORT, span[0]) for _ in range(FREE_PORT_TRIES)))
        if port is not None:
            return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out_ports:
            _handed_out_ports.add(port)
            return port


def _first_free(host: str, candidates) -> int | None:
    """The first candidate not handed out before that binds now (marked handed out), or None."""
    for port in candidates:
        if port in _handed_out_ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out_ports.add(port)
        return port
    return None


def threads_per_rank(num_ranks: int) -> int:
    """CPU threads for each of num_ranks workers on this host: the cores split between the ranks.
    The frontend and the scheduler work mostly while the worker waits for its next plan; a worker
    drops to one thread while other processes take its cores (worker/cpu_share.py)."""
    try:
        num_cores = len(os.sched_getaffinity(0))
    except AttributeError:
        num_cores = os.cpu_count() or 1
    return max(1, num_cores // num_ranks)


@dataclass(kw_only=True, slots=True)
class ServeOptions:
    """The options of `serve` itself (the processes' options it takes are their configs')."""

    max_worker_restarts: int = option(
        DEFAULT_MAX_RESTARTS, metavar="N", serve=True,
        help="restart the workers this many times in a row when one dies, resuming the requests in "
             "flight, after a back-off of 1 s doubling up to 30 s (0: a dead worker leaves the "
             "replica unready)")
    max_scheduler_restarts: int = option(
        DEFAULT_MAX_RESTARTS, metavar="N", serve=True,
        help="restart the scheduler this many times in a row when it dies, on the same ports "
             "(0: a dead scheduler stops serve)")
    max_frontend_restarts: int = option(
        DEFAULT_MAX_RESTARTS, metavar="N", serve=True,
        help="restart the frontend this many times in a row when it dies, on the same ports, after "
             "the same back-off (its open streams end with UNAVAILABLE; 0: a dead frontend stops serve)")
    restart_reset_after_s: float = option(
        DEFAULT_RESET_AFTER_S, flag="--restart-reset-after", metavar="SECONDS", serve=True,
        help="the restart budgets and back-off start over once the replica has been ready this long")
    scheduler_port: int | None = option(None, metavar="P", serve=True,
                                        help="internal scheduler gRPC port on 127.0.0.1 (default: a free port)")
    scheduler_metrics_port: int | None = option(
        None, metavar="P", serve=True, help="the scheduler's Prometheus /metrics port (default: --metrics-port + 1)")
    data_parallel_size: int = option(
        1, metavar="N", serve=True,
        help="replicas on this host behind the one frontend, each a scheduler and its tensor-parallel "
             "worker ranks with its own ports and a share of the CPU cores")
    replica_index: int | None = option(
        None, metavar="I", serve=True,
        help="set by serve --data-parallel-size for its replicas: run replica I alone (scheduler and "
             "workers, no frontend)")

    def __post_init__(self) -> None:
        require(self.max_worker_restarts >= 0, "max_worker_restarts", "must be >= 0")
        require(self.max_scheduler_restarts >= 0, "max_scheduler_restarts", "must be >= 0")
        require(self.max_frontend_restarts >= 0, "max_frontend_restarts", "must be >= 0")
        require(self.restart_reset_after_s >= 0, "restart_reset_after_s", "must be >= 0")
        require(self.data_parallel_size >= 1, "data_parallel_size", "must be >= 1")
        require(self.replica_index is None or 0 <= self.replica_index < self.data_parallel_size,
                "replica_index", "must be in [0, --data-parallel-size)")
        for name in ("scheduler_port", "scheduler_metrics_port"):
            value = getattr(self, name)
            require(value is None or 0 <= value <= 65535, name, f"must be a port number (0-65535), not {value}")


SERVE_CONFIGS = (FrontendConfig, ServeOptions, SchedulerServerConfig, WorkerConfig)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, *SERVE_CONFIGS, serve_only=True)


@dataclass(kw_only=True)
class ServeConfig:
    options: ServeOptions
    frontend: FrontendConfig
    scheduler: SchedulerServerConfig
    workers: list[WorkerConfig]
    env: dict[str, str] | None = field(default=None)  # the children's environment (None: serve's)
    replica_args: list[list[str]] = field(default_factory=list)  # --data-parallel-size > 1: each replica's
    replica_addresses: list[str] = field(default_factory=list)  # ... and its scheduler's address

    @property
    def is_replica_only(self) -> bool:
        """A replica of a --data-parallel-size serve: scheduler and workers, no frontend."""
        return self.options.replica_index is not None

    @property
    def has_replica_children(self) -> bool:
        """serve --data-parallel-size N > 1 itself: replicas and a frontend, no scheduler of its own."""
        return bool(self.replica_args)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeConfig":
        """The children's configs from `serve`'s parsed flags (see the module docstring)."""
        options = from_args(ServeOptions, args, serve_only=True)
        check_draft_flags(args.speculative_method, args.speculative_model)
        model = str(resolve_model(args.model))
        draft_model = str(resolve_model(args.speculative_model)) if args.speculative_model else None
        num_replicas = options.data_parallel_size
        metrics_port = args.metrics_port or None
        scheduler_metrics_port = options.scheduler_metrics_port
        if scheduler_metrics_port is None and metrics_port:
            scheduler_metrics_port = metrics_port + 1
        reserve_ports(args.port, args.http_port, metrics_port,
                      *(base + index for base in (options.scheduler_port, scheduler_metrics_port) if base
                        for index in range(num_replicas)))
        replica_ports: list[int] = []
        if num_replicas > 1 and options.replica_index is None:
            base = options.scheduler_port
            replica_ports = [base + index if base else free_port() for index in range(num_replicas)]
        scheduler_port = (replica_ports[0] if replica_ports else None) or options.scheduler_port or free_port()
        plan, result, dist = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
        recovery_timeout = WORKER_RECOVERY_SECONDS if options.max_worker_restarts > 0 else 0.0
        scheduler = from_args(
            SchedulerServerConfig, args, serve_only=True, model_path=model, port=scheduler_port,
            plan_address=plan, result_address=result, metrics_port=scheduler_metrics_port or None,
            engine=from_args(SchedulerConfig, args, serve_only=True, worker_recovery_timeout=recovery_timeout))
        num_ranks = scheduler.tensor_parallel_size
        # with OMP_NUM_THREADS set, torch follows what the operator set
        num_threads = None if "OMP_NUM_THREADS" in os.environ else threads_per_rank(num_ranks * num_replicas)
        workers = [from_args(WorkerConfig, args, serve_only=True, model_path=model, rank=rank,
                             plan_address=plan, result_address=result, dist_init_address=dist,
                             num_threads=num_threads, speculative_model=draft_model)
                   for rank in range(num_ranks)]
        addresses = [f"127.0.0.1:{port}" for port in replica_ports or [scheduler_port]]
        frontend = from_args(FrontendConfig, args, serve_only=True, model_path=model,
                             metrics_port=metrics_port, scheduler_address=",".join(addresses))
        replica_args = []
        for index, port in enumerate(replica_ports):
            replica_metrics_port = scheduler_metrics_port + index if scheduler_metrics_port else None
            replica_args.append(["serve", *serve_argv(args, {
                "model": model, "speculative_model": draft_model, "replica_index": index, "scheduler_port": port,
                "scheduler_metrics_port": replica_metrics_port})])
        return cls(options=options, frontend=frontend, scheduler=scheduler, workers=workers,
                   replica_args=replica_args, replica_addresses=addresses if replica_ports else [])

    @property
    def model(self) -> str:
        return self.scheduler.model_path

    @property
    def public_address(self) -> str:
        return f"{self.frontend.host}:{self.frontend.port}"

    def deployment(self) -> Deployment:
        """The flags serve checks against the model and the host before starting anything."""
        worker = self.workers[0]
        return Deployment(tensor_parallel_size=worker.world_size, device=worker.device, dtype=worker.dtype,
                          block_size=worker.block_size, max_model_len=self.scheduler.engine.max_model_len,
                          num_kv_blocks=self.scheduler.engine.num_gpu_blocks,
                          kv_cache_memory_gib=worker.kv_cache_memory_gib, swap_space_gib=worker.swap_space_gib,
                          kv_offloading_size_gib=worker.kv_offloading_size_gib)

    @property
    def scheduler_address(self) -> str:
        """Where serve asks the scheduler whether the replica is ready."""
        return f"127.0.0.1:{self.scheduler.port}"

    def restart_policy(self, group: str) -> RestartPolicy:
        """How the "workers", the "scheduler" or the "frontend" are started again after a crash."""
        max_restarts = {"workers": self.options.max_worker_restarts,
                        "scheduler": self.options.max_scheduler_restarts,
                        "frontend": self.options.max_frontend_restarts}[group]
        return RestartPolicy(max_restarts=max_restarts, reset_after_s=self.options.restart_reset_after_s)

    @property
    def shutdown_timeout(self) -> float:
        """The longer drain of frontend and scheduler."""
        return max(self.frontend.shutdown_timeout, self.scheduler.shutdown_timeout)

    @property
    def scheduler_args(self) -> list[str]:
        return ["scheduler", *to_argv(self.scheduler)]

    @property
    def worker_args(self) -> list[list[str]]:
        return [["worker", *to_argv(worker)] for worker in self.workers]

    @property
    def frontend_args(self) -> list[str]:
        return ["frontend", *to_argv(self.frontend)]


def check_draft_flags(speculative_method: str, speculative_model: str | None) -> None:
    """Raises ConfigError unless a draft model is named exactly when the method is draft."""
    require(speculative_method != "draft" or bool(speculative_model), "speculative_model",
            "--speculative-method draft needs --speculative-model PATH (the draft model)")
    require(speculative_method == "draft" or not speculative_model, "speculative_model",
            f"--speculative-model is for --speculative-method draft, not {speculative_method}")


def serve_argv(args: argparse.Namespace, overrides: dict[str, object]) -> list[str]:
    """The flags of a replica's `serve` that reproduce parsed args (with overrides by argparse
    dest; None: left out): serve's own, the scheduler's and the workers', none of the frontend's
    (a replica has none; its credentials stay off the replica's command line)."""
    argv: list[str] = []
    seen: set[str] = set()
    for config_class in (ServeOptions, SchedulerServerConfig, WorkerConfig):
        for flag in flags_of(config_class, serve_only=True):
            if flag.dest in seen or flag.is_positional:
                continue
            seen.add(flag.dest)
            value = overrides[flag.dest] if flag.dest in overrides else getattr(args, flag.dest, None)
            if value is None:
                continue
            if flag.kind is bool:
                argv.append(flag.name if value else "--no-" + flag.name.removeprefix("--"))
            else:
                argv += [flag.name, str(value)]
    return argv
