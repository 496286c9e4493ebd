"""Command-line flags derived from config dataclasses, and the way back to argv.

A process's config dataclass is the one definition of its settings: each field says, in its
metadata, how the command line reaches it. Three kinds of field:

    block_size: int = option(16, help="tokens per KV cache block", serve=True)
    transport: TransportConfig = nested(TransportConfig, title="public port transport")
    startup_timeout: float = internal(600.0)       # set in code, never on the command line

option() gives the flag (`--block-size`, from the field name unless `flag=` says otherwise), its
help, choices and metavar; the type, the default and whether it may be None come from the field
itself. `serve=True` puts the flag on `pagedserve serve` too, which forwards it to that process.
A bool field becomes `--flag / --no-flag`. A field with none of the three is an error, so a new
setting cannot be left off the command line by accident.

    add_flags(parser, WorkerConfig)               # one argparse argument per option, nested ones too
    config = from_args(WorkerConfig, args, rank=1)  # built (and validated) from parsed args
    argv = to_argv(config)                        # the flags that reproduce it

Validation stays in each dataclass's __post_init__ and raises ConfigError naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any

_KEY = "pagedserve.config.flags"


class ConfigError(ValueError):
    """A config field's value is out of range; `field_name` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name
        self.message = message


def require(is_valid: bool, field_name: str, message: str) -> None:
    """Raises ConfigError(field_name, message) unless is_valid."""
    if not is_valid:
        raise ConfigError(field_name, message)


@dataclass(frozen=True, slots=True)
class _Option:
    help: str
    flag: str | None = None  # None: --field-name
    choices: tuple | None = None
    metavar: str | None = None
    serve: bool = False
    is_repeatable: bool = False
    takes_several: bool = False


@dataclass(frozen=True, slots=True)
class _Nested:
    title: str | None


_INTERNAL = "internal"


def option(default: Any = MISSING, *, help: str, flag: str | None = None, choices: tuple | None = None,
           metavar: str | None = None, serve: bool = False, is_repeatable: bool = False,
           takes_several: bool = False) -> Any:
    """A field set by a command-line flag (see the module docstring). A flag without dashes is a
    positional argument (then the field has no default). is_repeatable (str fields): the flag may
    be given several times, the field holds the values joined by commas (`--scheduler-address A
    --scheduler-address B` is "A,B"), and to_argv writes the flag once per value. takes_several (with
    is_repeatable): one use of the flag may also take several values (`--lora-modules A=x B=y`)."""
    if takes_several and not is_repeatable:
        raise TypeError("takes_several needs is_repeatable")
    spec = _Option(help, flag, tuple(choices) if choices is not None else None, metavar, serve, is_repeatable,
                   takes_several)
    return dataclasses.field(default=default, metadata={_KEY: spec})


def nested(config_class: type, *, title: str | None = None) -> Any:
    """A field holding another config dataclass, whose options are flags of this one's command."""
    return dataclasses.field(default_factory=config_class, metadata={_KEY: _Nested(title)})


def internal(default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A field set in code (by the process, or by `serve` for its children), never by a flag."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: _INTERNAL})


@dataclass(frozen=True, slots=True)
class Flag:
    """One option field as the command line sees it."""

    owner: type
    field_name: str
    name: str  # --block-size, or the positional's name
    dest: str  # the attribute argparse stores it under
    kind: type  # int, float, str or bool (a `T | None` field: T)
    default: Any
    spec: _Option

    @property
    def is_positional(self) -> bool:
        return not self.name.startswith("-")


def _spec(config_class: type, field: dataclasses.Field) -> _Option | _Nested | str:
    spec = field.metadata.get(_KEY)
    if spec is None:
        raise TypeError(f"{config_class.__name__}.{field.name} has no command-line metadata: declare it with "
                        f"option(), nested() or internal() (pagedserve.config.flags)")
    return spec


def _default(field: dataclasses.Field) -> Any:
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return MISSING


def _kind(config_class: type, name: str, annotation: Any) -> type:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = tuple(arg for arg in typing.get_args(annotation) if arg is not type(None))
        if len(args) != 1:
            raise TypeError(f"{config_class.__name__}.{name}: only `T | None` unions can be flags")
        annotation = args[0]
    if annotation not in (int, float, str, bool):
        raise TypeError(f"{config_class.__name__}.{name}: a flag must be int, float, str or bool, not {annotation}")
    return annotation


def _walk(config_class: type):
    """(field, spec, resolved type) of every field of config_class."""
    hints = typing.get_type_hints(config_class)
    for field in fields(config_class):
        yield field, _spec(config_class, field), hints[field.name]


def _flag_name(field: dataclasses.Field, spec: _Option) -> str:
    return spec.flag or "--" + field.name.replace("_", "-")


def _dest(flag_name: str) -> str:
    return flag_name.lstrip("-").replace("-", "_")


def _flag(config_class: type, field: dataclasses.Field, spec: _Option, annotation: Any) -> Flag:
    name = _flag_name(field, spec)
    return Flag(config_class, field.name, name, _dest(name), _kind(config_class, field.name, annotation),
                _default(field), spec)


def flags_of(config_class: type, *, serve_only: bool = False) -> list[Flag]:
    """Every option of config_class and of its nested configs, in declaration order."""
    found = []
    for field, spec, annotation in _walk(config_class):
        if isinstance(spec, _Nested):
            found += flags_of(annotation, serve_only=serve_only)
        elif isinstance(spec, _Option) and (spec.serve or not serve_only):
            found.append(_flag(config_class, field, spec, annotation))
    return found


def add_flags(parser: argparse.ArgumentParser, *config_classes: type, serve_only: bool = False) -> list[Flag]:
    """Adds every option of config_classes (with serve_only, those marked serve=True) to parser,
    a nested config's in an argument group of its own. A flag that two classes share (`serve`
    takes --model for all three processes) is added once and must have the same type, default
    and choices in each. Returns the flags added."""
    added: dict[str, Flag] = {}
    groups: dict[str, Any] = {}
    for config_class in config_classes:
        _add(parser, parser, config_class, serve_only, added, groups)
    return list(added.values())


def _add(parser, group, config_class: type, serve_only: bool, added: dict[str, Flag], groups: dict) -> None:
    for field, spec, annotation in _walk(config_class):
        if isinstance(spec, _Nested):
            title = spec.title or annotation.__name__
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            _add(parser, groups[title], annotation, serve_only, added, groups)
            continue
        if not isinstance(spec, _Option) or (serve_only and not spec.serve):
            continue
        flag = _flag(config_class, field, spec, annotation)
        seen = added.get(flag.dest)
        if seen is not None:
            if (seen.kind, seen.default, seen.spec.choices) != (flag.kind, flag.default, flag.spec.choices):
                raise TypeError(f"{flag.name} differs between {seen.owner.__name__}.{seen.field_name} and "
                                f"{flag.owner.__name__}.{flag.field_name} (type, default or choices)")
            continue
        added[flag.dest] = flag
        kwargs: dict[str, Any] = {"help": spec.help}
        if spec.is_repeatable:
            if flag.kind is not str:
                raise TypeError(f"{flag.owner.__name__}.{flag.field_name}: only a str flag may be repeatable")
            kwargs["action"] = _JoinRepeats
            if spec.takes_several:
                kwargs["nargs"] = "+"
        if flag.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if flag.kind is not str:
                kwargs["type"] = flag.kind
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if spec.metavar is not None:
                kwargs["metavar"] = spec.metavar
        if flag.is_positional:
            group.add_argument(flag.name, **kwargs)
        else:
            group.add_argument(flag.name, default=flag.default, **kwargs)


class _JoinRepeats(argparse.Action):
    """A repeatable str flag: the first use replaces the default, later ones append ",value"."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        marker = f"_repeated_{self.dest}"
        if isinstance(values, list):  # takes_several: one use with several values
            values = ",".join(values)
        if getattr(namespace, marker, False):
            values = f"{getattr(namespace, self.dest)},{values}"
        setattr(namespace, self.dest, values)
        setattr(namespace, marker, True)


def from_args(config_class: type, args: argparse.Namespace, *, serve_only: bool = False, **overrides: Any):
    """config_class built from parsed args: each option from its flag (the field's default when
    the parser lacks that flag; with serve_only, for every option not marked serve=True, since
    `serve`'s flag of that name may belong to another process), each nested config likewise,
    `overrides` as given. Validation errors of config_class propagate."""
    values = {}
    for field, spec, annotation in _walk(config_class):
        if field.name in overrides:
            values[field.name] = overrides.pop(field.name)
        elif isinstance(spec, _Nested):
            values[field.name] = from_args(annotation, args, serve_only=serve_only)
        elif isinstance(spec, _Option) and (spec.serve or not serve_only):
            dest = _dest(_flag_name(field, spec))
            if hasattr(args, dest):
                values[field.name] = getattr(args, dest)
    if overrides:
        raise TypeError(f"{config_class.__name__} has no field {', '.join(overrides)}")
    return config_class(**values)


def to_argv(config) -> list[str]:
    """The flags that make from_args rebuild `config` from a parser of its class: every option,
    nested configs included, whose value is not None (None is then its default). Explicit, so a
    child's command line says everything it runs with (`ps` shows a worker's --rank)."""
    argv: list[str] = []
    for field, spec, _ in _walk(type(config)):
        value = getattr(config, field.name)
        if isinstance(spec, _Nested):
            argv += to_argv(value)
            continue
        name = f"{type(config).__name__}.{field.name}"
        if not isinstance(spec, _Option):
            if value != _default(field):
                raise ValueError(f"{name} = {value!r} is not its default and has no flag to carry it")
            continue
        if value is None and _default(field) is None:
            continue
        flag = _flag_name(field, spec)
        if not flag.startswith("-") or value is None:
            raise ValueError(f"{name} = {value!r} cannot be written as {flag}")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif spec.is_repeatable:
            for part in str(value).split(","):
                argv += [flag, part]
        else:
            argv += [flag, str(value)]
    return argv
