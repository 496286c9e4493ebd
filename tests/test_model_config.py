"""pagedserve.checkpoints.model_config reads config.json as transformers does, keys left out included."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from pagedserve.checkpoints.model_config import ModelConfigError, load_model_info, model_info_from_dict

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2)


def _hf_windows(config) -> tuple[int | None, ...]:
    """The window each layer of transformers' model attends with (as its attention modules read it)."""
    if isinstance(config, MistralConfig):
        return (config.sliding_window,) * config.num_hidden_layers if config.sliding_window else ()
    windows = tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)
    return windows if any(windows) else ()


@pytest.mark.parametrize("config_class, extra", [
    (MistralConfig, {}),  # sliding_window left out: transformers' 4096
    (MistralConfig, {"sliding_window": None}),
    (MistralConfig, {"sliding_window": 48}),
    (Qwen2Config, {}),  # use_sliding_window left out: off
    (Qwen2Config, {"sliding_window": 48}),  # a window, but not used
    (Qwen2Config, {"use_sliding_window": True}),  # 4096 from max_window_layers (28) on: none of 6 layers
    (Qwen2Config, {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 4}),
    (Qwen2Config, {"use_sliding_window": True, "sliding_window": 48,
                   "layer_types": ["sliding_attention", "full_attention"] * 3}),
])
def test_sliding_windows_follow_transformers(config_class, extra):
    written = {"architectures": [config_class.__name__.replace("Config", "ForCausalLM")], **SHAPE, **extra}
    info = model_info_from_dict(written)
    assert info.layer_sliding_windows == _hf_windows(config_class(**SHAPE, **extra))
    saved = config_class(**SHAPE, **extra).to_dict() | {"architectures": written["architectures"]}
    assert model_info_from_dict(saved).layer_sliding_windows == info.layer_sliding_windows


@pytest.mark.parametrize("config_class, biases", [
    (LlamaConfig, (False, False, False)), (MistralConfig, (False, False, False)), (Qwen2Config, (True, False, False)),
])
def test_family_biases(config_class, biases):
    info = model_info_from_dict({"architectures": [config_class.__name__.replace("Config", "ForCausalLM")], **SHAPE})
    assert (info.has_qkv_bias, info.has_o_bias, info.has_mlp_bias) == biases
    assert (info.head_size, info.num_kv_heads) == (8, 2)


def test_folder_adds_generation_eos_ids_and_names_missing_keys(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], **SHAPE, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    info = load_model_info(tmp_path)
    assert (info.name, info.eos_token_ids, info.max_position_embeddings) == (tmp_path.name, [2, 7], 2048)
    with pytest.raises(ModelConfigError, match="lacks 'num_hidden_layers'"):
        model_info_from_dict({key: value for key, value in config.items() if key != "num_hidden_layers"})
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model_info(tmp_path / "missing")
