"""The Llama-family architecture parameters our model needs, built from pagedserve.checkpoints.model_config's
ModelInfo (the one reader of config.json, where the family differences are read) plus the RoPE
settings only the worker uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedserve.checkpoints.model_config import (
    SUPPORTED_ARCHITECTURES, ModelConfigError, ModelInfo, load_model_info, model_info_from_dict,
)
from pagedserve.worker.layers.rotary import RopeConfig, RopeConfigError


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
        return cls.from_model_info(load_model_info(folder))

    @classmethod
    def from_hf_dict(cls, config: dict) -> "LlamaModelConfig":
        return cls.from_model_info(model_info_from_dict(config))

    @classmethod
    def from_model_info(cls, info: ModelInfo) -> "LlamaModelConfig":
        if info.hidden_act != "silu":
            raise ModelConfigError(f"hidden_act {info.hidden_act!r} is not supported (only 'silu')")
        if info.intermediate_size is None:
            raise ModelConfigError("config.json lacks 'intermediate_size'")
        try:
            rope = RopeConfig.from_hf_config(info.hf_config, info.head_size)
        except RopeConfigError as error:
            raise ModelConfigError(str(error)) from None
        return cls(
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            hidden_size=info.hidden_size,
            intermediate_size=info.intermediate_size,
            num_layers=info.num_layers,
            num_heads=info.num_heads,
            num_kv_heads=info.num_kv_heads,
            head_size=info.head_size,
            rms_norm_eps=info.rms_norm_eps,
            rope=rope,
            max_position_embeddings=info.max_position_embeddings,
            tie_word_embeddings=info.tie_word_embeddings,
            has_qkv_bias=info.has_qkv_bias,
            has_o_bias=info.has_o_bias,
            has_mlp_bias=info.has_mlp_bias,
            layer_sliding_windows=info.layer_sliding_windows,
        )
