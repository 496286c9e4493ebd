"""compose.yaml and the Dockerfile agree with our command line and with each other.

Every `command` (with compose's `${VAR:-default}` defaults filled in) and the Dockerfile's CMD must
be accepted by `pagedserve`'s argument parser, and the services must form one replica: the
scheduler's tensor-parallel size equals the number of worker services, ranks 0…N-1 each with one
GPU of its own, workers and frontends pointed at the scheduler's bound ports, one rendezvous
address on the rank-0 service; each service mounts only the secrets of its role.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pagedserve.cli import build_parser
from pagedserve.security.internal_token import INTERNAL_TOKEN_FILE_ENV
from pagedserve.security.zmq_curve import KEY_FILES, ROLE_ENVS

ROOT = Path(__file__).resolve().parent.parent
VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value: str) -> str:
    """compose's ${VAR:-default} / ${VAR-default} with the defaults (the environment is not read)."""
    def default(match: re.Match) -> str:
        if match.group(2) is None:
            raise AssertionError(f"{match.group(0)} has no default in compose.yaml")
        return match.group(2)

    return VARIABLE.sub(default, value)


def _services() -> dict[str, dict]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return {name: service for name, service in compose["services"].items()
            if not name.startswith("x-")}


def _parse(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"pagedserve rejects {argv} (exit {exc.code})") from None


def _commands() -> dict[str, object]:
    """service name -> parsed arguments of its command."""
    parsed = {}
    for name, service in _services().items():
        command = service.get("command")
        assert isinstance(command, list), f"{name}: command must be a list of arguments"
        parsed[name] = _parse([_interpolate(str(part)) for part in command])
    return parsed


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def test_every_compose_command_is_accepted_by_the_cli():
    commands = _commands()
    assert {args.command for args in commands.values()} == {"scheduler", "worker", "frontend"}


def test_dockerfile_runs_pagedserve_and_its_default_command_is_accepted():
    instructions = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        keyword, _, rest = line.partition(" ")
        if keyword in ("ENTRYPOINT", "CMD"):
            instructions[keyword] = json.loads(rest)
    assert instructions["ENTRYPOINT"] == ["pagedserve"]
    assert _parse(instructions["CMD"]).command == "serve"


def test_services_form_one_tensor_parallel_replica():
    services, commands = _services(), _commands()
    (scheduler_name,) = [name for name, args in commands.items() if args.command == "scheduler"]
    scheduler = commands[scheduler_name]
    workers = {name: args for name, args in commands.items() if args.command == "worker"}
    frontends = {name: args for name, args in commands.items() if args.command == "frontend"}

    assert scheduler.tensor_parallel_size == len(workers) >= 2
    assert sorted(args.rank for args in workers.values()) == list(range(len(workers)))
    plan_port = _host_port(scheduler.plan_address)[1]
    result_port = _host_port(scheduler.result_address)[1]
    (rank_zero,) = [name for name, args in workers.items() if args.rank == 0]
    assert {args.dist_init_address for args in workers.values()} == {
        next(iter(workers.values())).dist_init_address}
    gpus = []
    for name, args in workers.items():
        assert args.tensor_parallel_size == len(workers), name
        assert _host_port(args.plan_address) == (scheduler_name, plan_port), name
        assert _host_port(args.result_address) == (scheduler_name, result_port), name
        assert _host_port(args.dist_init_address)[0] == rank_zero, name
        (reservation,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia" and "gpu" in reservation["capabilities"], name
        assert len(reservation["device_ids"]) == 1, f"{name} must reserve exactly one GPU"
        gpus += reservation["device_ids"]
    assert len(set(gpus)) == len(workers), "each rank needs a GPU of its own"

    assert frontends
    for name, args in frontends.items():
        assert args.scheduler_address == f"{scheduler_name}:{scheduler.port}", name
        assert services[name]["deploy"]["replicas"] >= 2, name
    assert len({args.model for args in commands.values()}) == 1, "one model for every process"


@pytest.mark.parametrize("text, expected", [("${MODEL:-demo}", "demo"), ("${MODEL-/m}", "/m"),
                                            ("tcp://*:1", "tcp://*:1")])
def test_interpolation_uses_the_defaults(text, expected):
    assert _interpolate(text) == expected


def test_each_service_mounts_only_the_secrets_of_its_role():
    """The scheduler: the internal token, its CURVE key pair and the workers' public key; a worker:
    its key pair and the scheduler's public key; a frontend: the token. Each from a secret file
    named as `python -m pagedserve.security.zmq_curve DIR` writes it."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    declared = {name: spec["file"] for name, spec in compose["secrets"].items()}
    for name, args in _commands().items():
        service = _services()[name]
        environment = service.get("environment", {})
        mounted = set(service.get("secrets", []))
        expected = {f"{key}_FILE" for key in ROLE_ENVS[args.command]}
        if args.command in ("scheduler", "frontend"):
            expected.add(f"{INTERNAL_TOKEN_FILE_ENV}")
        assert set(environment) == expected, name
        for variable, path in environment.items():
            secret = path.removeprefix("/run/secrets/")
            assert secret in mounted and secret in declared, (name, variable)
            key = variable.removesuffix("_FILE")
            if key in KEY_FILES:
                assert declared[secret] == f"./secrets/zmq/{KEY_FILES[key]}", (name, variable)
        assert len(mounted) == len(environment), f"{name} mounts a secret it does not use"
