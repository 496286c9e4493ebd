"""The one reader of a checkpoint folder's config.json (and generation_config.json); no torch.

Every process reads the model through load_model_info: the frontend (EOS ids), the scheduler
(name, vocabulary, context length, EOS ids) and the worker (dtype, and everything its
LlamaModelConfig is built from). Keys that config.json may leave out take the value transformers
gives them, so a folder means the same thing here as in transformers.

Family differences, read here rather than in the model:

    architecture          q/k/v bias        o bias            MLP bias    sliding window
    LlamaForCausalLM      attention_bias    attention_bias    mlp_bias    none
    MistralForCausalLM    no                no                no          every layer: sliding_window
                                                                          (absent: 4096, null: none)
    Qwen2ForCausalLM      yes               no                no          only with use_sliding_window
                                                                          (default false): the layers
                                                                          layer_types marks, else
                                                                          those from max_window_layers
                                                                          (default 28) on

RoPE keys (rope_parameters, or rope_scaling + rope_theta) are the worker's alone: they stay in
`hf_config` for pagedserve.worker.layers.rotary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from pagedserve.checkpoints.gguf_config import is_gguf, read_gguf_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# transformers' defaults for keys a config.json may leave out
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048
DEFAULT_SLIDING_WINDOW = 4096  # MistralConfig, Qwen2Config
DEFAULT_QWEN2_MAX_WINDOW_LAYERS = 28


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: Path | None
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    intermediate_size: int | None = None  # the MLP's (only the worker needs it)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    has_mlp_bias: bool = False
    layer_sliding_windows: tuple[int | None, ...] = ()  # per layer; empty = no sliding window anywhere
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)  # config.json as read


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from exc


def load_model_info(path: str | Path) -> ModelInfo:
    """Reads config.json (and generation_config.json for EOS ids when present), or a GGUF header."""
    if is_gguf(path):
        return _from_gguf(path)
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelConfigError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    return model_info_from_dict(_read_json(config_path), folder=folder, generation_config=generation)


def model_info_from_dict(config: dict, *, folder: Path | None = None,
                         generation_config: dict | None = None) -> ModelInfo:
    """A ModelInfo from config.json's dict (and generation_config.json's, which adds EOS ids)."""
    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else ""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    eos_ids = _as_id_list(config.get("eos_token_id"))
    for token_id in _as_id_list((generation_config or {}).get("eos_token_id")):
        if token_id not in eos_ids:
            eos_ids.append(token_id)
    try:
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        num_layers = int(config["num_hidden_layers"])
        return ModelInfo(
            name=folder.name if folder is not None else "",
            path=folder,
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_size=int(config.get("head_dim") or hidden_size // num_heads),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]) if "intermediate_size" in config else None,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            hidden_act=str(config.get("hidden_act", "silu")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            hf_config=config,
            **_family_options(architecture, config, num_layers),
        )
    except KeyError as missing:
        raise ModelConfigError(f"config.json lacks {missing}") from None


def _family_options(architecture: str, config: dict, num_layers: int) -> dict:
    if architecture == "LlamaForCausalLM":
        attention_bias = bool(config.get("attention_bias", False))
        return {"has_qkv_bias": attention_bias, "has_o_bias": attention_bias,
                "has_mlp_bias": bool(config.get("mlp_bias", False))}
    if architecture == "MistralForCausalLM":
        window = config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        return {"layer_sliding_windows": (int(window),) * num_layers if window else ()}
    # Qwen2ForCausalLM
    window = config.get("sliding_window", DEFAULT_SLIDING_WINDOW) if config.get("use_sliding_window", False) else None
    if not window:
        return {"has_qkv_bias": True}
    max_window_layers = int(config.get("max_window_layers", DEFAULT_QWEN2_MAX_WINDOW_LAYERS))
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i >= max_window_layers else "full_attention" for i in range(num_layers)
    ]
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    return {"has_qkv_bias": True, "layer_sliding_windows": windows if any(windows) else ()}


def _from_gguf(path: str | Path) -> ModelInfo:
    """The same information from a GGUF file's metadata (see pagedserve.checkpoints.gguf_config)."""
    gguf = read_gguf_config(path)
    info = model_info_from_dict(gguf.hf_config, generation_config={"eos_token_id": list(gguf.eos_token_ids)})
    return replace(info, name=gguf.name, path=Path(path))
