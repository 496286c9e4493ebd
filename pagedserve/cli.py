"""The `pagedserve` command: serve (all processes), frontend, scheduler, worker, generate."""

from __future__ import annotations

import argparse
import sys

from pagedserve.service_options import (
    add_shutdown_arg, add_transport_args, add_waiting_tokens_arg, transport_from_args,
)
from pagedserve.supervisor import ServeConfig, run_serve

DEFAULT_SCHEDULER_PORT = 50052
DEFAULT_PLAN_ADDRESS = "tcp://127.0.0.1:50061"
DEFAULT_RESULT_ADDRESS = "tcp://127.0.0.1:50062"
DEFAULT_DIST_INIT_ADDRESS = "tcp://127.0.0.1:50063"


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo",
                        help="Hugging Face checkpoint folder, or `demo` for the built-in model")


def _add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--swap-space", type=float, default=4.0, metavar="GIB",
                        help="CPU swap space per rank for preempted KV blocks")
    parser.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                        help="memory for the KV pool per rank (default: derived from the device)")


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool size in blocks (overrides the memory-derived size)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--preemption-mode", choices=["auto", "swap", "recompute"], default="auto")
    parser.add_argument("--max-waiting-requests", type=int, default=4096)
    add_waiting_tokens_arg(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start scheduler, workers and frontend together")
    _add_model(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--tensor-parallel-size", type=int, default=1)
    serve.add_argument("--max-worker-restarts", type=int, default=3,
                       help="restart the workers this many times when one dies, resuming the "
                            "requests in flight (0: a dead worker leaves the replica unready)")
    serve.add_argument("--scheduler-port", type=int, default=None,
                       help="internal scheduler gRPC port on 127.0.0.1 (default: a free port)")
    serve.add_argument("--metrics-port", type=int, default=None)
    serve.add_argument("--scheduler-metrics-port", type=int, default=None,
                       help="default: --metrics-port + 1")
    _add_worker_args(serve)
    _add_engine_args(serve)
    add_shutdown_arg(serve)
    add_transport_args(serve)

    frontend = sub.add_parser("frontend", help="the public gRPC frontend alone")
    _add_model(frontend)
    frontend.add_argument("--host", default="127.0.0.1")
    frontend.add_argument("--port", type=int, default=50051)
    frontend.add_argument("--scheduler-address", default=f"127.0.0.1:{DEFAULT_SCHEDULER_PORT}")
    frontend.add_argument("--metrics-port", type=int, default=None)
    add_shutdown_arg(frontend)
    add_transport_args(frontend)

    scheduler = sub.add_parser("scheduler", help="the scheduler alone")
    _add_model(scheduler)
    scheduler.add_argument("--host", default="127.0.0.1")
    scheduler.add_argument("--port", type=int, default=DEFAULT_SCHEDULER_PORT)
    scheduler.add_argument("--plan-address", default=DEFAULT_PLAN_ADDRESS)
    scheduler.add_argument("--result-address", default=DEFAULT_RESULT_ADDRESS)
    scheduler.add_argument("--tensor-parallel-size", type=int, default=1)
    scheduler.add_argument("--metrics-port", type=int, default=None)
    scheduler.add_argument("--heartbeat-timeout", type=float, default=10.0)
    scheduler.add_argument("--worker-recovery-timeout", type=float, default=0.0, metavar="SECONDS",
                           help="when workers are lost, hold the requests in flight this long "
                                "for them to register again (0: fail them at once)")
    add_shutdown_arg(scheduler)
    _add_engine_args(scheduler)

    worker = sub.add_parser("worker", help="one worker rank alone")
    _add_model(worker)
    worker.add_argument("--rank", type=int, default=0)
    worker.add_argument("--tensor-parallel-size", type=int, default=1)
    worker.add_argument("--plan-address", default=DEFAULT_PLAN_ADDRESS)
    worker.add_argument("--result-address", default=DEFAULT_RESULT_ADDRESS)
    worker.add_argument("--dist-init-address", default=DEFAULT_DIST_INIT_ADDRESS,
                        help="rendezvous of the tensor-parallel ranks: tcp://RANK0_HOST:PORT")
    worker.add_argument("--dist-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long a rank waits in a collective (or the rendezvous) for the others")
    worker.add_argument("--num-threads", type=int, default=None,
                        help="torch CPU threads of this rank (default: torch's choice)")
    worker.add_argument("--block-size", type=int, default=16)
    _add_worker_args(worker)

    generate = sub.add_parser("generate", help="stream a completion to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--address", default="127.0.0.1:50051")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    return parser


def engine_config_from_args(args, max_position_embeddings: int):
    from pagedserve.scheduler.engine import EngineConfig

    max_model_len = min(args.max_model_len or max_position_embeddings, max_position_embeddings)
    return EngineConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        worker_recovery_timeout=getattr(args, "worker_recovery_timeout", 0.0),
    )


def _run_scheduler(args) -> int:
    from pagedserve.models.resolve import resolve_model
    from pagedserve.model_config import load_model_info
    from pagedserve.scheduler.server import SchedulerServerConfig, run_scheduler

    model_path = resolve_model(args.model)
    info = load_model_info(model_path)
    config = SchedulerServerConfig(
        model_path=str(model_path), host=args.host, port=args.port,
        plan_address=args.plan_address, result_address=args.result_address,
        tensor_parallel_size=args.tensor_parallel_size, metrics_port=args.metrics_port,
        heartbeat_timeout=args.heartbeat_timeout, shutdown_timeout=args.shutdown_timeout)
    return run_scheduler(config, engine_config_from_args(args, info.max_position_embeddings))


def _run_worker(args) -> int:
    from pagedserve.models.resolve import resolve_model
    from pagedserve.worker.process import WorkerConfig, run_worker

    config = WorkerConfig(
        model_path=str(resolve_model(args.model)), plan_address=args.plan_address,
        result_address=args.result_address, rank=args.rank, world_size=args.tensor_parallel_size,
        device=args.device, dtype=args.dtype, block_size=args.block_size,
        swap_space_gib=args.swap_space, dist_init_address=args.dist_init_address,
        dist_timeout_s=args.dist_timeout, num_threads=args.num_threads,
        kv_cache_memory_gib=args.kv_cache_memory)
    return run_worker(config)


def _run_frontend(args) -> int:
    from pagedserve.models.resolve import resolve_model
    from pagedserve.frontend.server import run_frontend

    return run_frontend(model_path=str(resolve_model(args.model)),
                        scheduler_address=args.scheduler_address, host=args.host, port=args.port,
                        metrics_port=args.metrics_port, max_concurrent_rpcs=args.max_concurrent_rpcs,
                        shutdown_timeout_s=args.shutdown_timeout, transport=transport_from_args(args))


def _run_generate(args) -> int:
    from pagedserve.frontend.client import generate_cli

    return generate_cli(args.address, args.prompt, max_tokens=args.max_tokens,
                        temperature=args.temperature, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(ServeConfig.from_args(args))
        runner = {"scheduler": _run_scheduler, "worker": _run_worker, "frontend": _run_frontend,
                  "generate": _run_generate}[args.command]
        return runner(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"pagedserve {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
