"""The LoRA adapters this frontend serves by name: from --lora-modules at start, and loaded or
unloaded at runtime (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) when allowed.

A name resolves to an AdapterRef (name, absolute folder, content digest) that travels with each
request to the scheduler; a request in flight keeps the ref it started with, so unloading or
reloading an adapter never changes what a running request computes. An adapter is checked when it
is registered (pagedserve.adapters.peft_folder: files, shapes against the base model, rank
against --max-lora-rank) and refused with the reason; nothing else changes then.

With several frontends each has its own registry: runtime loads reach only the frontend that got
them (the --lora-modules given to serve reach all).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pagedserve.adapters.peft_folder import AdapterError, AdapterSpec, ModelShapes, model_shapes, read_adapter
from pagedserve.checkpoints.model_config import load_model_info
from pagedserve.contracts.request_types import AdapterRef


class UnknownAdapter(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def parse_lora_modules(value: str) -> list[tuple[str, str]]:
    """"NAME=PATH,NAME=PATH" (--lora-modules, given once or several times) -> [(name, path)]."""
    modules = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes NAME=PATH, not {item!r}")
        modules.append((name.strip(), path.strip()))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {', '.join(sorted(names))}")
    return modules


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    spec: AdapterSpec

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.spec.name, self.spec.path, self.spec.digest)


class AdapterRegistry:
    def __init__(self, base_name: str, shapes: ModelShapes, *, max_rank: int) -> None:
        self.base_name = base_name
        self.shapes = shapes
        self.max_rank = max_rank
        self._adapters: dict[str, ServedAdapter] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, base_name: str, model_path: str, *, max_rank: int,
                  modules: list[tuple[str, str]] = ()) -> "AdapterRegistry":
        """Raises AdapterError for a --lora-modules adapter that cannot be served (the frontend
        then does not start: a flag given at start must be right)."""
        registry = cls(base_name, model_shapes(load_model_info(model_path)), max_rank=max_rank)
        for name, path in modules:
            registry.load(name, path)
        return registry

    def load(self, name: str, path: str, *, replace: bool = False) -> AdapterSpec:
        """Checks and registers the adapter; AdapterError (name taken, or a bad adapter) otherwise."""
        if not name or name == self.base_name:
            raise AdapterError(f"an adapter may not be named {name!r} (the base model's name)")
        spec = read_adapter(name, path, self.shapes, max_rank=self.max_rank)
        with self._lock:
            if name in self._adapters and not replace:
                raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
            self._adapters[name] = ServedAdapter(spec)
        return spec

    def unload(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise UnknownAdapter(name)

    def resolve(self, name: str | None) -> AdapterRef | None:
        """None for the base model (its name, or no name); raises UnknownAdapter."""
        if not name or name == self.base_name:
            return None
        with self._lock:
            served = self._adapters.get(name)
        if served is None:
            raise UnknownAdapter(name)
        return served.ref

    def adapters(self) -> list[AdapterSpec]:
        with self._lock:
            return [served.spec for served in self._adapters.values()]
