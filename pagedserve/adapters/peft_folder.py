"""Reads and checks a PEFT LoRA adapter folder without torch (frontend, scheduler and worker alike).

A folder holds adapter_config.json and adapter_model.safetensors whose tensors are named

    base_model.model.model.layers.{i}.{self_attn|mlp}.{q|k|v|o|gate|up|down}_proj.lora_{A|B}.weight

with lora_A [r, in_features] and lora_B [out_features, r]; the delta of a projection is
scale * B @ A with scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The shapes are
read from the safetensors header (8-byte length, then JSON), so a process without torch can refuse
a bad adapter before any worker sees it. The adapter is known by the SHA-256 of both files: the
digest, not the name, keys its KV in the prefix cache, so reloading other weights under the same
name never serves stale KV.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(PROJECTIONS)
                  + r")\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter folder that cannot be served on this model (the message says why)."""


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """The projection sizes of the base model an adapter must match."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_heads * head_size
    kv_size: int  # num_kv_heads * head_size

    def in_out(self, projection: str) -> tuple[int, int]:
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
                "o_proj": (self.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[projection]


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    path: str
    digest: str  # hex SHA-256 of adapter_config.json and adapter_model.safetensors
    rank: int
    scale: float
    # (layer, projection) -> (checkpoint name of lora_A, of lora_B)
    modules: dict[tuple[int, str], tuple[str, str]]


def model_shapes(info) -> ModelShapes:
    """From a pagedserve.checkpoints.model_config.ModelInfo."""
    if info.intermediate_size is None:
        raise AdapterError("the base model's config has no intermediate_size")
    return ModelShapes(info.num_layers, info.hidden_size, info.intermediate_size,
                       info.num_heads * info.head_size, info.num_kv_heads * info.head_size)


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise AdapterError(f"{path} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        if length > 100 << 20:
            raise AdapterError(f"{path} is not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AdapterError(f"{path} is not a safetensors file: {exc}") from None
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update(name.encode())
        with (folder / name).open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{folder / CONFIG_FILE} is not JSON: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not LORA")
    refused = {"use_dora": bool(config.get("use_dora")), "modules_to_save": bool(config.get("modules_to_save")),
               "bias": config.get("bias", "none") != "none", "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
               "rank_pattern": bool(config.get("rank_pattern")), "alpha_pattern": bool(config.get("alpha_pattern"))}
    if any(refused.values()):
        raise AdapterError(f"unsupported adapter_config.json options: {', '.join(k for k, v in refused.items() if v)}")
    return config


def read_adapter(name: str, path: str | Path, shapes: ModelShapes, *, max_rank: int) -> AdapterSpec:
    """Checks the folder against the base model's shapes and max_rank; raises AdapterError."""
    folder = Path(path)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / file).is_file():
            raise AdapterError(f"adapter {name!r}: {folder / file} is missing")
    config = _config(folder)
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    found: dict[tuple[int, str], dict[str, str]] = {}
    tensors = _safetensors_shapes(folder / WEIGHTS_FILE)
    for key, shape in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: tensor {key} is not a LoRA weight of q/k/v/o/gate/up/down")
        layer, projection, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= shapes.num_layers:
            raise AdapterError(f"adapter {name!r}: {key} names layer {layer}; the model has {shapes.num_layers}")
        in_size, out_size = shapes.in_out(projection)
        expected = (rank, in_size) if which == "A" else (out_size, rank)
        if shape != expected:
            raise AdapterError(f"adapter {name!r}: {key} has shape {list(shape)}, the base model needs "
                               f"{list(expected)} (rank {rank})")
        found.setdefault((layer, projection), {})[which] = key
    modules = {}
    for module, pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {module[0]} {module[1]} has lora_{''.join(pair)} only")
        modules[module] = (pair["A"], pair["B"])
    if not modules:
        raise AdapterError(f"adapter {name!r}: {folder / WEIGHTS_FILE} holds no LoRA weights")
    return AdapterSpec(name=name, path=str(folder.resolve()), digest=folder_digest(folder), rank=rank,
                       scale=float(scale), modules=modules)
