"""Builds small deterministic Llama-family checkpoints (for tests and the `--model demo` model).

The weights are drawn from a seeded generator with scales chosen so the model behaves like a
trained one numerically, not like a freshly initialised one (whose logits are all near zero and
whose greedy choices would hinge on rounding):

    embeddings     N(0, (logit_scale / sqrt(hidden))^2)  ->  logits spread with std ~ logit_scale
    linear layers  N(0, 1 / in_features), q and k x2     ->  unit activations, peaked attention,
                   o and down x3                          ->  layers outweigh the token's own
                                                              embedding (no echo with tied weights)
    biases         N(0, 0.5^2)                            ->  the bias path matters
    norm weights   N(1, 0.1^2)                            ->  the norm weights matter

so greedy decoding has clear margins between the best and second-best token and two correct
implementations agree token for token in float32.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGIT_SCALE = 4.0
QK_GAIN = 2.0
OUT_GAIN = 3.0


def _config_and_model_classes(architecture: str):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    return {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[architecture]


def _validate(architecture: str, dtype: str, hidden_size: int, num_heads: int, num_kv_heads: int) -> None:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, not {architecture!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(f"hidden_size {hidden_size} must split into {num_heads} heads of even size")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")


@contextmanager
def _quiet_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _initialise(model: torch.nn.Module, hidden_size: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                std, mean = LOGIT_SCALE / math.sqrt(hidden_size), 0.0
            elif "norm" in name:
                std, mean = 0.1, 1.0
            elif name.endswith(".bias"):
                std, mean = 0.5, 0.0
            else:
                gain = 1.0
                if "q_proj" in name or "k_proj" in name:
                    gain = QK_GAIN
                elif "o_proj" in name or "down_proj" in name:
                    gain = OUT_GAIN
                std, mean = gain / math.sqrt(param.shape[1]), 0.0
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std + mean
            param.copy_(values)


def build_tiny_checkpoint(
    folder: str | Path,
    *,
    architecture: str = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    eos_token_id: int = 2,
    bos_token_id: int = 1,
    dtype: str = "float32",
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
) -> Path:
    """Writes config.json, generation_config.json and model.safetensors into `folder`; returns it.

    rope_scaling: e.g. {"rope_type": "linear", "factor": 2.0} (merged into rope_parameters).
    sliding_window: Mistral only (other architectures ignore it here).
    """
    _validate(architecture, dtype, hidden_size, num_heads, num_kv_heads)
    from transformers import GenerationConfig

    config_class, model_class = _config_and_model_classes(architecture)
    rope_parameters = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        scaling = dict(rope_scaling)
        rope_parameters["rope_type"] = scaling.pop("rope_type", None) or scaling.pop("type", "default")
        scaling.pop("type", None)
        rope_parameters.update(scaling)
    options = {}
    if architecture == "mistral":
        options["sliding_window"] = sliding_window
    if architecture == "qwen2":
        options["use_sliding_window"] = False
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        rms_norm_eps=1e-6,
        rope_parameters=rope_parameters,
        **options,
    )
    config.architectures = [model_class.__name__]
    torch_dtype = DTYPES[dtype]
    model = model_class(config)
    _initialise(model, hidden_size, seed)
    model = model.to(torch_dtype).eval()
    model.config.dtype = torch_dtype
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(folder)
    GenerationConfig(bos_token_id=bos_token_id, eos_token_id=eos_token_id).save_pretrained(folder)
    return folder
