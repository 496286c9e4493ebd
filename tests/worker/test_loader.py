"""Checkpoint loading: sharded safetensors, dtype conversion, clear errors for mismatches."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.checkpoints.model_config import ModelConfigError
from pagedserve.cpu_features import has_native_bfloat16
from pagedserve.worker.loading.hf_checkpoint import CheckpointError, load_weights, resolve_dtype
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.llama_config import LlamaModelConfig

NAME = "qwen2-bias-tied"


def _tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _copy_config(source, target) -> None:
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")


def _load(folder, dtype=torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaModelConfig.from_folder(folder), dtype=dtype)
    load_weights(model, folder)
    return model


def test_sharded_checkpoint_loads_like_the_single_file(checkpoint_dir, tmp_path):
    source = checkpoint_dir(NAME)
    tensors = _tensors(source)
    sharded = tmp_path / "sharded"
    _copy_config(source, sharded)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file_name, part in halves.items():
        save_file({name: tensors[name] for name in part}, sharded / file_name)
        weight_map.update({name: file_name for name in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single, split = _load(source), _load(sharded)
    for (name, a), (_, b) in zip(single.named_parameters(), split.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    qkv = single.layers[1].self_attn.qkv_proj
    q_rows = tensors["model.layers.1.self_attn.q_proj.weight"].shape[0]
    assert torch.equal(qkv.weight[:q_rows], tensors["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv.bias[q_rows:q_rows + 32], tensors["model.layers.1.self_attn.k_proj.bias"])
    assert single.lm_head.weight is single.embed_tokens.weight  # tied


def test_dtype_conversion(checkpoint_dir):
    model = _load(checkpoint_dir(NAME), dtype=torch.bfloat16)
    expected = _tensors(checkpoint_dir(NAME))["model.norm.weight"].to(torch.bfloat16)
    assert model.norm.weight.dtype == torch.bfloat16 and torch.equal(model.norm.weight, expected)
    expected_cpu = torch.bfloat16 if has_native_bfloat16() else torch.float32
    assert resolve_dtype("auto", "bfloat16", torch.device("cpu")) == expected_cpu
    assert resolve_dtype("auto", "float32", torch.device("cpu")) == expected_cpu
    assert resolve_dtype("auto", "bfloat16", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp16", None, torch.device("cpu")) == torch.float16
    with pytest.raises(CheckpointError, match="dtype"):
        resolve_dtype("int8", None, torch.device("cpu"))


def _rewrite(checkpoint_dir, tmp_path, edit) -> object:
    source = checkpoint_dir(NAME)
    target = tmp_path / "edited"
    _copy_config(source, target)
    tensors = _tensors(source)
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def test_missing_tensor_is_named(checkpoint_dir, tmp_path):
    folder = _rewrite(checkpoint_dir, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        _load(folder)


def test_unexpected_tensor_is_named(checkpoint_dir, tmp_path):
    folder = _rewrite(checkpoint_dir, tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\): model.extra.weight"):
        _load(folder)


def test_ignorable_tensors_are_accepted(checkpoint_dir, tmp_path):
    def add(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # tied: ignored
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _load(_rewrite(checkpoint_dir, tmp_path, add))


def test_misshapen_tensor_is_named(checkpoint_dir, tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:16]

    folder = _rewrite(checkpoint_dir, tmp_path, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \[16, 64\].*\[32, 64\]"):
        _load(folder)


def test_missing_weights_and_unsupported_configs(checkpoint_dir, tmp_path):
    empty = tmp_path / "empty"
    _copy_config(checkpoint_dir(NAME), empty)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        _load(empty)
    config = json.loads((checkpoint_dir(NAME) / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="RoPE type 'longrope'"):
        LlamaModelConfig.from_hf_dict({**config, "rope_parameters": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ModelConfigError, match="hidden_act"):
        LlamaModelConfig.from_hf_dict({**config, "hidden_act": "gelu"})
    with pytest.raises(ModelConfigError, match="architecture"):
        LlamaModelConfig.from_hf_dict({**config, "architectures": ["GPT2LMHeadModel"]})
