"""PEFT adapter folders checked without torch: what is refused, and why, and the content digest."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedserve.adapters.lora_config import LoraConfig
from pagedserve.adapters.peft_folder import AdapterError, ModelShapes, read_adapter
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.testing.lora_adapters import build_peft_adapter

SHAPES = ModelShapes(num_layers=2, hidden_size=64, intermediate_size=128, q_size=64, kv_size=32)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    base = build_tiny_checkpoint(tmp_path_factory.mktemp("base"), architecture="llama", vocab_size=128,
                                 hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                 max_position_embeddings=64, seed=3)
    return build_peft_adapter(base, tmp_path_factory.mktemp("adapter"), seed=1, alpha=32)


def test_reads_all_seven_projections_of_every_layer(adapter):
    spec = read_adapter("sql", adapter, SHAPES, max_rank=8)
    assert spec.rank == 8 and spec.scale == 4.0 and len(spec.digest) == 64
    assert sorted(spec.modules) == sorted((layer, p) for layer in range(2) for p in
                                          ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def test_refusals_name_the_problem(adapter, tmp_path):
    with pytest.raises(AdapterError, match="above --max-lora-rank 4"):
        read_adapter("sql", adapter, SHAPES, max_rank=4)
    with pytest.raises(AdapterError, match=r"has shape \[\d+, \d+\], the base model needs \[\d+, \d+\] \(rank 8\)"):
        read_adapter("sql", adapter, ModelShapes(2, 96, 128, 96, 32), max_rank=8)
    with pytest.raises(AdapterError, match="names layer 1; the model has 1"):
        read_adapter("sql", adapter, ModelShapes(1, 64, 128, 64, 32), max_rank=8)
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_adapter("none", tmp_path, SHAPES, max_rank=8)
    dora = tmp_path / "dora"
    shutil.copytree(adapter, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        read_adapter("dora", dora, SHAPES, max_rank=8)
    (dora / "adapter_model.safetensors").write_bytes(b"\x01")
    (dora / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="not a safetensors file"):
        read_adapter("dora", dora, SHAPES, max_rank=8)


def test_digest_follows_content_not_name_or_place(adapter, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy)
    first, second = read_adapter("a", adapter, SHAPES, max_rank=8), read_adapter("b", copy, SHAPES, max_rank=8)
    assert first.digest == second.digest
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 8}))
    changed = read_adapter("b", copy, SHAPES, max_rank=8)
    assert changed.digest != first.digest and changed.scale == 1.0


def test_lora_limits():
    assert LoraConfig(max_loras=2).num_cpu_loras == 2
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        LoraConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="--max-loras"):
        LoraConfig(max_loras=0)
