"""Every subcommand's flags are its config dataclass's fields, and `serve` hands its children
command lines that parse back to the configs it built.

For each subcommand the test sets every flag at once to a value other than its default, parses,
builds the config, and requires each flag's value in the field it names: a flag that reaches no
field, or a field without a flag, fails here.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.launch import serve_config
from pagedserve.cli import COMMANDS, build_parser
from pagedserve.config.flags import ConfigError, Flag, add_flags, flags_of, from_args, internal, option, to_argv
from pagedserve.frontend.client import GenerateOptions
from pagedserve.frontend.config import FrontendConfig
from pagedserve.scheduler.core.errors import SchedulerConfigError
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.server_config import SchedulerServerConfig
from pagedserve.launch.serve_config import SERVE_CONFIGS, ServeConfig, ServeOptions
from pagedserve.worker.config import WorkerConfig

PROCESS_CONFIGS = {"frontend": FrontendConfig, "scheduler": SchedulerServerConfig, "worker": WorkerConfig,
                   "generate": GenerateOptions}


def _command_flags(command: str) -> list[Flag]:
    if command == "serve":
        flags = {flag.dest: flag for config in SERVE_CONFIGS for flag in flags_of(config, serve_only=True)}
        return list(flags.values())
    return flags_of(PROCESS_CONFIGS[command])


def _subparser(command: str):
    parser = build_parser([command])
    (sub,) = [action for action in parser._actions if action.dest == "command"]
    return parser, sub.choices[command]


def _sample(flag: Flag, model: Path) -> tuple[list[str], object]:
    """A command-line piece setting `flag` to a value other than its default, and that value."""
    if flag.dest in ("model", "speculative_model"):  # serve resolves both: a checkpoint folder
        return [flag.name, str(model)], str(model)
    if flag.dest == "speculative_method":  # the one method a --speculative-model goes with
        return [flag.name, "draft"], "draft"
    if flag.dest == "lora_modules":  # NAME=PATH
        return [flag.name, f"a={model}"], f"a={model}"
    if flag.dest == "max_cpu_loras":  # at least --max-loras (default + 3)
        return [flag.name, "8"], 8
    if flag.kind is bool:
        value = not flag.default
        return [flag.name if value else "--no-" + flag.name.removeprefix("--")], value
    if flag.spec.choices is not None:
        value = next(choice for choice in flag.spec.choices if choice != flag.default)
    elif flag.kind is int:
        value = (flag.default or 0) + 3  # keeps rank < tensor-parallel size and tokens >= seqs
    elif flag.kind is float:
        value = (flag.default or 0.0) + 1.5
    else:
        value = f"{flag.default or flag.dest}-x"
    return ([str(value)] if flag.is_positional else [flag.name, str(value)]), value


def _every_flag_set(command: str, model: Path) -> tuple[list[str], dict[str, object]]:
    argv, expected = [command], {}
    for flag in _command_flags(command):
        piece, expected[flag.dest] = _sample(flag, model)
        argv += piece
    return argv, expected


def _values(config) -> dict[str, object]:
    """dest -> value of every option of config, nested configs included."""
    values = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            values |= _values(value)
    for flag in flags_of(type(config)):
        if flag.owner is type(config):
            values[flag.dest] = getattr(config, flag.field_name)
    return values


@pytest.fixture
def model(tmp_path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_every_config_field_is_a_flag_or_declared_internal():
    for config in (*PROCESS_CONFIGS.values(), SchedulerConfig, ServeOptions):
        flags_of(config)  # raises TypeError for a field declared with none of option/nested/internal

    @dataclasses.dataclass
    class Undeclared:
        block_size: int = 16

    with pytest.raises(TypeError, match="Undeclared.block_size has no command-line metadata"):
        flags_of(Undeclared)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_parser_has_exactly_the_config_flags(command):
    _, subparser = _subparser(command)
    parsed = {action.dest for action in subparser._actions if action.dest != "help"}
    assert parsed == {flag.dest for flag in _command_flags(command)}


@pytest.mark.parametrize("command", sorted(PROCESS_CONFIGS))
def test_every_flag_reaches_its_field_and_argv_rebuilds_the_config(command, model):
    parser, _ = _subparser(command)
    argv, expected = _every_flag_set(command, model)
    config = from_args(PROCESS_CONFIGS[command], parser.parse_args(argv))
    assert _values(config) == expected
    if command != "generate":  # the client command is never started by serve
        assert from_args(PROCESS_CONFIGS[command], parser.parse_args([command, *to_argv(config)])) == config
        default = PROCESS_CONFIGS[command]()
        assert from_args(PROCESS_CONFIGS[command], parser.parse_args([command, *to_argv(default)])) == default


def test_serve_children_get_every_serve_flag_and_their_argv_parses_back(model, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    argv, expected = _every_flag_set("serve", model)
    serve = ServeConfig.from_args(build_parser(["serve"]).parse_args(argv))
    assert len(serve.workers) == expected["tensor_parallel_size"]
    children = [("frontend", serve.frontend_args, serve.frontend), ("scheduler", serve.scheduler_args, serve.scheduler),
                *(("worker", args, worker) for args, worker in zip(serve.worker_args, serve.workers, strict=True))]
    reached = set(_values(serve.options))
    assert _values(serve.options) == {dest: expected[dest] for dest in reached}
    for command, child_argv, config in children:
        assert child_argv[0] == command
        parser, _ = _subparser(command)
        assert from_args(PROCESS_CONFIGS[command], parser.parse_args(child_argv)) == config
        serve_flags = {flag.dest for flag in flags_of(PROCESS_CONFIGS[command], serve_only=True)}
        values = _values(config)
        assert {dest: values[dest] for dest in serve_flags} == {dest: expected[dest] for dest in serve_flags}
        reached |= serve_flags
    assert reached == set(expected), "a serve flag reaches no child"


def test_serve_decides_ports_recovery_and_threads(model, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(serve_config.os, "sched_getaffinity", lambda pid: set(range(8)))
    args = build_parser(["serve"]).parse_args(["serve", "--model", str(model), "--metrics-port", "9100",
                                               "--tensor-parallel-size", "2", "--scheduler-port", "6000"])
    serve = ServeConfig.from_args(args)
    assert serve.scheduler.metrics_port == 9101 and serve.frontend.metrics_port == 9100
    assert serve.scheduler.port == 6000 and serve.frontend.scheduler_address == "127.0.0.1:6000"
    assert serve.scheduler.host == "127.0.0.1" and serve.frontend.host == "127.0.0.1"
    assert serve.scheduler.engine.worker_recovery_timeout == serve_config.WORKER_RECOVERY_SECONDS
    assert [worker.rank for worker in serve.workers] == [0, 1]
    assert [args[args.index("--rank") + 1] for args in serve.worker_args] == ["0", "1"]  # what `ps` shows
    assert {worker.num_threads for worker in serve.workers} == {4}
    assert {(w.plan_address, w.result_address) for w in serve.workers} == {
        (serve.scheduler.plan_address, serve.scheduler.result_address)}
    no_restarts = ServeConfig.from_args(build_parser(["serve"]).parse_args(
        ["serve", "--model", str(model), "--max-worker-restarts", "0"]))
    assert no_restarts.scheduler.engine.worker_recovery_timeout == 0.0
    args = no_restarts.scheduler_args
    assert args[args.index("--worker-recovery-timeout") + 1] == "0.0"


def test_invalid_values_raise_config_errors_naming_the_field(model):
    parser = build_parser()
    cases = [(["serve", "--model", str(model), "--max-worker-restarts", "-1"], "max_worker_restarts"),
             (["serve", "--model", str(model), "--block-size", "0"], "block_size"),
             (["worker", "--rank", "2", "--tensor-parallel-size", "2"], "rank"),
             (["frontend", "--tls-cert", "c.pem"], "tls_key_file"),
             (["scheduler", "--max-num-seqs", "4096"], "max_num_batched_tokens")]
    for argv, field_name in cases:
        args = parser.parse_args(argv)
        with pytest.raises(ConfigError) as raised:
            if args.command == "serve":
                ServeConfig.from_args(args)
            else:
                from_args(PROCESS_CONFIGS[args.command], args)
        assert raised.value.field_name == field_name, argv
    assert issubclass(SchedulerConfigError, ConfigError)


def test_a_flag_shared_by_two_configs_must_agree():
    import argparse

    @dataclasses.dataclass
    class First:
        block_size: int = option(16, help="tokens per block", serve=True)
        startup_timeout: float = internal(1.0)

    @dataclasses.dataclass
    class Second:
        block_size: int = option(32, help="tokens per block", serve=True)

    with pytest.raises(TypeError, match="--block-size differs between First.block_size and Second.block_size"):
        add_flags(argparse.ArgumentParser(), First, Second, serve_only=True)
    with pytest.raises(ValueError, match="no flag"):
        to_argv(First(startup_timeout=2.0))


@pytest.mark.parametrize("command, foreign", [
    ("scheduler", ("pagedserve.frontend", "pagedserve.worker", "torch")),
    ("frontend", ("pagedserve.scheduler", "pagedserve.worker", "torch")),
    ("worker", ("pagedserve.frontend", "pagedserve.scheduler", "torch")),
])
def test_a_process_parses_its_flags_without_importing_another_process(command, foreign):
    code = (f"import sys; from pagedserve.cli import build_parser; "
            f"build_parser([{command!r}]).parse_args([{command!r}]); "
            f"print(sorted({{'.'.join(m.split('.')[:2]) for m in sys.modules}} & set({foreign!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_metrics_host_binds_metrics_apart_from_the_api(model):
    public = ServeConfig.from_args(build_parser(["serve"]).parse_args(
        ["serve", "--model", str(model), "--host", "0.0.0.0", "--metrics-port", "9100"]))
    # loopback unless asked: a public API does not publish the metrics with it
    assert public.frontend.resolved_metrics_host == public.scheduler.resolved_metrics_host == "127.0.0.1"
    private = ServeConfig.from_args(build_parser(["serve"]).parse_args(
        ["serve", "--model", str(model), "--host", "0.0.0.0", "--metrics-port", "9100", "--metrics-host", "10.1.2.3"]))
    assert private.frontend.resolved_metrics_host == private.scheduler.resolved_metrics_host == "10.1.2.3"
    assert private.frontend.host == "0.0.0.0"


def test_serve_passes_the_draft_model_to_every_worker_and_checks_the_method(model, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    parser = build_parser(["serve"])
    serve = ServeConfig.from_args(parser.parse_args(
        ["serve", "--model", str(model), "--tensor-parallel-size", "2", "--speculative-method", "draft",
         "--speculative-model", str(draft), "--speculative-quantization", "int4", "--data-parallel-size", "2"]))
    assert serve.scheduler.engine.speculative_method == "draft"
    for args in serve.worker_args:
        assert args[args.index("--speculative-model") + 1] == str(draft)
        assert args[args.index("--speculative-quantization") + 1] == "int4"
    assert "--speculative-model" not in serve.scheduler_args and "--speculative-model" not in serve.frontend_args
    for args in serve.replica_args:  # each replica's serve starts its own workers with the same draft
        assert args[args.index("--speculative-model") + 1] == str(draft)
        assert args[args.index("--speculative-method") + 1] == "draft"
    plain = ServeConfig.from_args(parser.parse_args(["serve", "--model", str(model)]))
    assert "--speculative-model" not in plain.worker_args[0]
    assert plain.worker_args[0][plain.worker_args[0].index("--speculative-quantization") + 1] == "none"
    cases = [["--speculative-method", "draft"],
             ["--speculative-model", str(draft)],
             ["--speculative-method", "ngram", "--speculative-model", str(draft)]]
    for extra in cases:
        with pytest.raises(ConfigError) as raised:
            ServeConfig.from_args(parser.parse_args(["serve", "--model", str(model), *extra]))
        assert raised.value.field_name == "speculative_model", extra
        assert "\n" not in str(raised.value)
    with pytest.raises(FileNotFoundError):  # a draft model serve cannot find: refused as --model is
        ServeConfig.from_args(parser.parse_args(["serve", "--model", str(model), "--speculative-method", "draft",
                                                 "--speculative-model", str(tmp_path / "missing")]))
