"""The Llama-family architecture parameters our model needs, read from a config.json dict.

Family differences handled here rather than in the model:

    architecture          q/k/v bias        o bias            MLP bias    sliding window
    LlamaForCausalLM      attention_bias    attention_bias    mlp_bias    none
    MistralForCausalLM    no                no                no          every layer (sliding_window)
    Qwen2ForCausalLM      yes               no                no          layer_types, when use_sliding_window
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedserve.gguf_config import is_gguf, read_gguf_config
from pagedserve.model_config import SUPPORTED_ARCHITECTURES, ModelConfigError
from pagedserve.worker.rotary import RopeConfig, RopeConfigError


@dataclass(frozen=True, slots=True)
class LlamaModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    has_mlp_bias: bool = False
    layer_sliding_windows: tuple[int | None, ...] = ()  # per layer; empty = no sliding window anywhere

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(f"architecture {self.architecture!r} is not supported")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, not {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.layer_sliding_windows and len(self.layer_sliding_windows) != self.num_layers:
            raise ModelConfigError(
                f"{len(self.layer_sliding_windows)} per-layer sliding windows for {self.num_layers} layers"
            )

    def sliding_window(self, layer_index: int) -> int | None:
        return self.layer_sliding_windows[layer_index] if self.layer_sliding_windows else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "LlamaModelConfig":
        if is_gguf(folder):  # a .gguf file, or a folder holding one
            return cls.from_hf_dict(read_gguf_config(folder).hf_config)
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{folder} has no config.json")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_hf_dict(cls, config: dict) -> "LlamaModelConfig":
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else ""
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise ModelConfigError(f"hidden_act {activation!r} is not supported (only 'silu')")
        try:
            num_heads = int(config["num_attention_heads"])
            hidden_size = int(config["hidden_size"])
            num_layers = int(config["num_hidden_layers"])
            head_size = int(config.get("head_dim") or hidden_size // num_heads)
            rope = RopeConfig.from_hf_config(config, head_size)
            return cls(
                architecture=architecture,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_size=head_size,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                **_family_options(architecture, config, num_layers),
            )
        except KeyError as missing:
            raise ModelConfigError(f"config.json lacks {missing}") from None
        except RopeConfigError as error:
            raise ModelConfigError(str(error)) from None


def _family_options(architecture: str, config: dict, num_layers: int) -> dict:
    if architecture == "LlamaForCausalLM":
        attention_bias = bool(config.get("attention_bias", False))
        return {"has_qkv_bias": attention_bias, "has_o_bias": attention_bias,
                "has_mlp_bias": bool(config.get("mlp_bias", False))}
    if architecture == "MistralForCausalLM":
        window = config.get("sliding_window")
        return {"layer_sliding_windows": (int(window),) * num_layers if window else ()}
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    if not window:
        return {"has_qkv_bias": True}
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i >= int(config.get("max_window_layers", num_layers)) else "full_attention"
        for i in range(num_layers)
    ]
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    return {"has_qkv_bias": True, "layer_sliding_windows": windows}
