"""GGUF metadata read as a config.json: the same model config, EOS ids, chat template, clear errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pagedserve.checkpoints.gguf_config import (
    GGUFFormatError,
    UnsupportedGGUFError,
    find_gguf_file,
    is_gguf,
    read_gguf_config,
)
from pagedserve.checkpoints.model_config import load_model_info
from pagedserve.testing.tiny_gguf import write_gguf
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.worker.models.llama_config import LlamaModelConfig

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    sizes = dict(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                 max_position_embeddings=768, seed=7)
    return {
        "llama": build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), architecture="llama", rope_theta=5e5,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0}, **sizes),
        "qwen2": build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), architecture="qwen2",
                                       tie_word_embeddings=True, eos_token_id=5, **sizes),
    }


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_model_config_equals_the_checkpoints(architecture, checkpoints, tmp_path):
    checkpoint = checkpoints[architecture]
    path = write_gguf(checkpoint, tmp_path / "model.gguf", chat_template=TEMPLATE)
    from_gguf, from_json = LlamaModelConfig.from_folder(path), LlamaModelConfig.from_folder(checkpoint)
    assert from_gguf.rms_norm_eps == pytest.approx(from_json.rms_norm_eps, rel=1e-6)  # GGUF keeps a float32
    assert dataclasses.replace(from_gguf, rms_norm_eps=from_json.rms_norm_eps) == from_json
    info, json_info = load_model_info(path), load_model_info(checkpoint)
    assert info.name == "model" and info.path == path
    for field in ("architecture", "vocab_size", "max_position_embeddings", "num_layers", "num_heads",
                  "num_kv_heads", "head_size", "hidden_size", "eos_token_ids", "layer_sliding_windows", "tie_word_embeddings",
                  "has_qkv_bias", "intermediate_size"):
        assert getattr(info, field) == getattr(json_info, field), field
    config = read_gguf_config(tmp_path)  # the folder holding it
    assert config.chat_template == TEMPLATE
    assert config.hf_config["tie_word_embeddings"] == (architecture == "qwen2")
    assert config.bos_token_id == 1


def _gguf_with(tmp_path, *, name="x.gguf", arch="llama", metadata=(), tensors=None) -> str:
    """A minimal GGUF: the llama keys a config needs, a token embedding, and what the test adds."""
    path = tmp_path / name
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, kind, value in metadata:
        writer.add_key_value(key, value, kind)
    tensors = tensors or {"token_embd.weight": (np.zeros((16, 32), np.float32), None)}
    for tensor_name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_eos_ids_gather_eot_and_eom(tmp_path):
    u32 = gguf.GGUFValueType.UINT32
    path = _gguf_with(tmp_path, metadata=[("tokenizer.ggml.eos_token_id", u32, 2),
                                          ("tokenizer.ggml.eot_token_id", u32, 9),
                                          ("tokenizer.ggml.eom_token_id", u32, 2)])
    config = read_gguf_config(path)
    assert config.eos_token_ids == (2, 9)
    assert config.hf_config["eos_token_id"] == [2, 9]
    assert config.hf_config["vocab_size"] == 16
    assert load_model_info(path).eos_token_ids == [2, 9]


def test_rope_scaling_keys(tmp_path):
    f32, text = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    path = _gguf_with(tmp_path, metadata=[("llama.rope.scaling.type", text, "linear"),
                                          ("llama.rope.scaling.factor", f32, 4.0)])
    assert read_gguf_config(path).hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert LlamaModelConfig.from_folder(path).rope.params == {"factor": 4.0}
    path = _gguf_with(tmp_path, name="longrope.gguf", metadata=[("llama.rope.scaling.type", text, "longrope")])
    with pytest.raises(UnsupportedGGUFError, match="RoPE scaling type 'longrope'"):
        read_gguf_config(path)


def test_unsupported_architecture_is_named(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"], tmp_path / "gemma.gguf", architecture="gemma")
    with pytest.raises(UnsupportedGGUFError, match="GGUF architecture 'gemma' is not supported"):
        read_gguf_config(path)
    with pytest.raises(ValueError, match="gemma"):
        load_model_info(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    iq4 = np.zeros((16, 32 // 32 * 18), np.uint8)  # IQ4_NL: 18-byte blocks of 32 values
    path = _gguf_with(tmp_path, tensors={"token_embd.weight": (iq4, gguf.GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(UnsupportedGGUFError, match="tensor type IQ4_NL is not supported .*token_embd.weight"):
        read_gguf_config(path)


def test_rope_frequency_tensor_is_refused(tmp_path):
    tensors = {"token_embd.weight": (np.zeros((16, 32), np.float32), None),
               "rope_freqs.weight": (np.ones(8, np.float32), None)}
    with pytest.raises(UnsupportedGGUFError, match="rope_freqs.weight"):
        read_gguf_config(_gguf_with(tmp_path, tensors=tensors))


@pytest.mark.parametrize("keep", [100, 2000, "half", "all_but_one"])
def test_truncated_file_is_named(checkpoints, tmp_path, keep):
    whole = write_gguf(checkpoints["llama"], tmp_path / "whole.gguf").read_bytes()
    size = {"half": len(whole) // 2, "all_but_one": len(whole) - 1}.get(keep, keep)
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:size])
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf_config(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        read_gguf_config(path)


def test_missing_required_key_is_named(tmp_path):
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFFormatError, match="lacks the GGUF metadata key llama.embedding_length"):
        read_gguf_config(path)


def test_which_paths_are_gguf_models(tmp_path):
    folder = tmp_path / "one"
    folder.mkdir()
    assert not is_gguf(folder) and not is_gguf(tmp_path / "nowhere")
    (folder / "a.gguf").write_bytes(b"GGUF")
    (folder / "tokenizer.json").write_text("{}")
    assert find_gguf_file(folder) == folder / "a.gguf" and is_gguf(folder / "a.gguf")
    (folder / "config.json").write_text("{}")
    assert not is_gguf(folder)  # a Hugging Face checkpoint folder
    (folder / "config.json").unlink()
    (folder / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFFormatError, match="2 .gguf files"):
        find_gguf_file(folder)


def test_config_is_cached_per_file_version(checkpoints, tmp_path, monkeypatch):
    import pagedserve.checkpoints.gguf_config as gguf_config

    path = write_gguf(checkpoints["qwen2"], tmp_path / "model.gguf", chat_template=TEMPLATE)
    first = read_gguf_config(path)
    gguf_config._read_cached.cache_clear()  # a new process: only the cache on disk is left

    def no_reading(*args):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_config, "open_gguf", no_reading)
    assert read_gguf_config(path) == first
    monkeypatch.undo()
    write_gguf(checkpoints["llama"], path)  # a new version of the file: read again
    assert read_gguf_config(path).architecture == "llama"


def test_reading_needs_no_torch(checkpoints, tmp_path):
    path = write_gguf(checkpoints["qwen2"], tmp_path / "model.gguf")
    code = ("import sys; from pagedserve.checkpoints.model_config import load_model_info; "
            f"info = load_model_info({str(path)!r}); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(info.num_layers)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"


def test_cached_config_is_json(checkpoints, tmp_path):
    from pagedserve.checkpoints.gguf_cache import derived_folder

    path = write_gguf(checkpoints["qwen2"], tmp_path / "model.gguf")
    read_gguf_config(path)
    cached = json.loads((derived_folder(path) / "config-v1.json").read_text())
    assert cached["hf_config"]["architectures"] == ["Qwen2ForCausalLM"]
