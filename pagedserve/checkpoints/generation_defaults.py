"""The model's own sampling defaults (`--generation-config auto|vllm|FOLDER`); no torch.

A request that leaves a sampling field out gets the model's default for it, as vLLM gives it:

    --generation-config   where the defaults come from
    auto (the default)    an HF folder's generation_config.json; a GGUF file's `general.sampling.*`
                          metadata; else the published default of a known model (KNOWN_MODELS)
    vllm                  none: every protocol's neutral defaults (HTTP: temperature 1, top_p 1;
                          gRPC: proto3 zeros, temperature 0 = greedy)
    FOLDER                FOLDER/generation_config.json

Fields read (generation_config.json key -> request field): temperature, top_p, top_k, min_p,
repetition_penalty. As in vLLM, `do_sample` is not read (a config with `temperature` samples at it)
and a field the model does not set keeps the protocol's neutral default.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

GENERATION_CONFIG_MODES = ("auto", "vllm")
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
             "top_k": "general.sampling.top_k", "min_p": "general.sampling.min_p",
             "repetition_penalty": "general.sampling.penalty_repeat"}


class GenerationConfigError(ValueError):
    """--generation-config names nothing readable, or its file holds a value out of range."""


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Each field: the model's default, or None where the protocol's neutral default applies."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = "none (neutral defaults)"  # where they come from (shown by GET /v1/models)

    def fields(self) -> dict[str, float | int]:
        """The fields the model sets (name -> value)."""
        return {name: value for name, value in asdict(self).items() if name in FIELDS and value is not None}


NEUTRAL = SamplingDefaults()

# Published defaults of the known models whose files carry none. SmolLM2-135M-Instruct: the
# sampling its model card's usage example recommends (temperature 0.2, top_p 0.9); its GGUF has no
# sampling metadata.
KNOWN_MODELS = {
    "smollm2": SamplingDefaults(temperature=0.2, top_p=0.9,
                                source="SmolLM2-135M-Instruct model card (temperature 0.2, top_p 0.9)"),
}


def load_sampling_defaults(mode: str, model_path: str | Path, served_name: str | None = None) -> SamplingDefaults:
    """The defaults `--generation-config mode` gives the model at model_path (served as
    served_name, which names a known model)."""
    if mode == "vllm":
        return NEUTRAL
    if mode != "auto":
        folder = Path(mode).expanduser()
        file = folder / "generation_config.json"
        if not file.is_file():
            raise GenerationConfigError(f"--generation-config {mode}: no generation_config.json in that folder "
                                        f"(or use auto or vllm)")
        return _from_dict(_read_json(file), str(file))
    from pagedserve.checkpoints.gguf_config import is_gguf

    path = Path(model_path).expanduser()
    defaults = NEUTRAL
    if is_gguf(path):
        defaults = _from_gguf(path)
    elif (path / "generation_config.json").is_file():
        defaults = _from_dict(_read_json(path / "generation_config.json"), str(path / "generation_config.json"))
    if not defaults.fields() and served_name in KNOWN_MODELS:
        return KNOWN_MODELS[served_name]
    return defaults


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{file} does not hold a JSON object")
    return data


def _from_gguf(path: Path) -> SamplingDefaults:
    from pagedserve.checkpoints.gguf_config import open_gguf

    reader = open_gguf(path)
    values = {}
    for name, key in GGUF_KEYS.items():
        found = reader.fields.get(key)
        if found is not None:
            values[name] = found.contents()
    return _from_dict(values, f"{path} (GGUF general.sampling.*)") if values else NEUTRAL


def _from_dict(data: dict, source: str) -> SamplingDefaults:
    values = {}
    for name in FIELDS:
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise GenerationConfigError(f"{source}: {name} must be a number, not {value!r}")
        values[name] = int(value) if name == "top_k" else float(value)
    if values.get("top_k", 0) < 0:
        values["top_k"] = 0  # -1 and 0 both mean off
    _check(values, source)
    return SamplingDefaults(**values, source=source) if values else NEUTRAL


def _check(values: dict, source: str) -> None:
    checks = {"temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1, "min_p": lambda v: 0 <= v <= 1,
              "repetition_penalty": lambda v: v > 0, "top_k": lambda v: v >= 0}
    for name, value in values.items():
        if not checks[name](value):
            raise GenerationConfigError(f"{source}: {name} {value} is out of range")
