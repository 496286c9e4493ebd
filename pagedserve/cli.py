"""The `pagedserve` command: serve (all processes), frontend, scheduler, worker, generate.

Every subcommand's flags are derived from its config dataclass (pagedserve.config.flags):

    frontend    pagedserve.frontend.config.FrontendConfig
    scheduler   pagedserve.scheduler.server_config.SchedulerServerConfig (engine: SchedulerConfig)
    worker      pagedserve.worker.config.WorkerConfig
    generate    pagedserve.frontend.client.GenerateOptions
    serve       pagedserve.launch.serve_config: ServeOptions and the options of the three processes
                marked serve=True

A process imports only its own config: `main` builds the parser of the subcommand it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pagedserve.config.flags import add_flags, from_args


@dataclass(frozen=True, slots=True)
class Command:
    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # a long-running server: once `run` returns (its shutdown done and logged) the process ends
    # with pagedserve.teardown.end_process, skipping the interpreter's finalization
    ends_at_once: bool = False


def _add_frontend_flags(parser: argparse.ArgumentParser) -> None:
    from pagedserve.frontend.config import FrontendConfig

    add_flags(parser, FrontendConfig)


def _add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    from pagedserve.scheduler.server_config import SchedulerServerConfig

    add_flags(parser, SchedulerServerConfig)


def _add_worker_flags(parser: argparse.ArgumentParser) -> None:
    from pagedserve.worker.config import WorkerConfig

    add_flags(parser, WorkerConfig)


def _add_generate_flags(parser: argparse.ArgumentParser) -> None:
    from pagedserve.frontend.client import GenerateOptions

    add_flags(parser, GenerateOptions)


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    from pagedserve.launch.serve_config import add_serve_flags

    add_serve_flags(parser)


def _resolved(config):
    """config with its --model resolved to a checkpoint folder (the demo model built on first use)."""
    from pagedserve.checkpoints.resolve import resolve_model

    return replace(config, model_path=str(resolve_model(config.model_path)))


def _run_frontend(args: argparse.Namespace) -> int:
    from pagedserve.frontend.config import FrontendConfig
    from pagedserve.frontend.server import run_frontend

    return run_frontend(_resolved(from_args(FrontendConfig, args)))


def _run_scheduler(args: argparse.Namespace) -> int:
    from pagedserve.scheduler.server import run_scheduler
    from pagedserve.scheduler.server_config import SchedulerServerConfig

    return run_scheduler(_resolved(from_args(SchedulerServerConfig, args)))


def _run_worker(args: argparse.Namespace) -> int:
    from pagedserve.worker.cpu_share import choose_openmp_waits
    from pagedserve.worker.config import WorkerConfig

    adapts_threads = choose_openmp_waits()  # before torch loads
    from pagedserve.checkpoints.resolve import resolve_model
    from pagedserve.worker.process import run_worker

    config = _resolved(from_args(WorkerConfig, args))
    if config.speculative_model is not None:  # the same forms as --model
        config = replace(config, speculative_model=str(resolve_model(config.speculative_model)))
    return run_worker(config, adapts_threads=adapts_threads)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve.frontend.client import GenerateOptions, generate_cli

    return generate_cli(from_args(GenerateOptions, args))


def _run_serve(args: argparse.Namespace) -> int:
    from pagedserve.launch.serve_config import ServeConfig
    from pagedserve.launch.supervisor import run_serve

    return run_serve(ServeConfig.from_args(args))


COMMANDS = {
    "serve": Command("start scheduler, workers and frontend together", _add_serve_flags, _run_serve,
                     ends_at_once=True),
    "frontend": Command("the public gRPC frontend alone", _add_frontend_flags, _run_frontend,
                        ends_at_once=True),
    "scheduler": Command("the scheduler alone", _add_scheduler_flags, _run_scheduler,
                         ends_at_once=True),
    "worker": Command("one worker rank alone", _add_worker_flags, _run_worker, ends_at_once=True),
    "generate": Command("stream a completion to the terminal", _add_generate_flags, _run_generate),
}


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of `commands` only."""
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in commands or COMMANDS:
        command = COMMANDS[name]
        command.add_flags(sub.add_parser(name, help=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedserve.launch.parent_death import die_with_parent

    die_with_parent()  # a child of `serve` exits with it
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser([argv[0]] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    command = COMMANDS[args.command]
    try:
        code = command.run(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"pagedserve {args.command}: {exc}", file=sys.stderr)
        code = 2
    if command.ends_at_once:
        from pagedserve.teardown import end_process

        end_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
