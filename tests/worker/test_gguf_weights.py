"""GGUF loading: our weights, logits and greedy tokens equal transformers' own GGUF loader's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import make_prompts
from gguf_fixtures import GGUF_FILE, GGUF_MODELS, gguf_model, hf_gguf_model  # noqa: F401 (fixtures)
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.testing.tiny_gguf import llama_cpp_permute, write_gguf
from pagedserve.contracts.step_plan import SampleSpec
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.worker.quantization.gguf_blocks import to_int4_groups, to_int8_groups
from pagedserve.worker.loading.gguf_weights import GGUFCheckpoint, gguf_tensor_name, unpermute_rows
from pagedserve.worker.loading.hf_checkpoint import CheckpointError, load_weights
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.llama_config import LlamaModelConfig

NUM_BLOCKS = 64
MAX_NEW_TOKENS = 10
NUM_LOGPROBS = 5


def _load(path, dtype=torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaModelConfig.from_folder(path), dtype=dtype)
    load_weights(model, path)
    return model


def test_unpermute_rows_inverts_llama_cpp_permutation():
    weights = np.arange(3 * 8 * 2, dtype=np.float32).reshape(24, 2)  # 3 heads of 8 rows
    permuted = llama_cpp_permute(weights, num_heads=3)
    assert not np.array_equal(permuted, weights)
    assert np.array_equal(permuted[unpermute_rows(24, 8)], weights)
    assert np.array_equal(permuted[8 + unpermute_rows(8, 8)], weights[8:16])  # one head on its own


def test_tensor_names():
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.layers.3.self_attn.o_proj.weight") == "blk.3.attn_output.weight"
    assert gguf_tensor_name("model.layers.0.self_attn.q_proj.bias") == "blk.0.attn_q.bias"
    assert gguf_tensor_name("model.layers.11.post_attention_layernorm.weight") == "blk.11.ffn_norm.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    with pytest.raises(CheckpointError, match="rotary"):
        gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("name", list(GGUF_MODELS))
def test_weights_equal_transformers_dequantized(name, gguf_model, hf_gguf_model):
    ours = _load(gguf_model(name))
    state = hf_gguf_model(name).state_dict()
    config = ours.config
    q, kv = config.num_heads * config.head_size, config.num_kv_heads * config.head_size
    assert torch.equal(ours.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert torch.equal(ours.lm_head.weight, state["lm_head.weight"])
    assert ours.lm_head.is_tied == GGUF_MODELS[name][0]["tie_word_embeddings"]
    assert torch.equal(ours.norm.weight, state["model.norm.weight"])
    for i, layer in enumerate(ours.layers):
        prefix = f"model.layers.{i}"
        qkv = torch.cat([state[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert qkv.shape[0] == q + 2 * kv
        if layer.self_attn.qkv_proj.bias is not None:
            bias = torch.cat([state[f"{prefix}.self_attn.{p}_proj.bias"] for p in "qkv"])
            assert torch.equal(layer.self_attn.qkv_proj.bias, bias)
        assert torch.equal(layer.self_attn.o_proj.weight, state[f"{prefix}.self_attn.o_proj.weight"])
        gate_up = torch.cat([state[f"{prefix}.mlp.gate_proj.weight"], state[f"{prefix}.mlp.up_proj.weight"]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(layer.mlp.down_proj.weight, state[f"{prefix}.mlp.down_proj.weight"])
        assert torch.equal(layer.input_layernorm.weight, state[f"{prefix}.input_layernorm.weight"])
        assert torch.equal(layer.post_attention_layernorm.weight, state[f"{prefix}.post_attention_layernorm.weight"])


@pytest.mark.parametrize("name", list(GGUF_MODELS))
def test_greedy_tokens_and_logprobs_equal_transformers(name, gguf_model, hf_gguf_model):
    runner = ModelRunner(gguf_model(name) / GGUF_FILE, device="cpu", dtype="float32", block_size=16)
    runner.load()
    runner.init_cache(NUM_BLOCKS, 0)
    driver = PlanDriver(runner, NUM_BLOCKS)
    prompts = make_prompts(seed=3, lengths=(1, 17, 40, 90))
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS,
                      spec=SampleSpec(num_logprobs=NUM_LOGPROBS)) for i, prompt in enumerate(prompts)]
    driver.run_to_completion(seqs, token_budget=64)
    samples = {}
    for result in driver.results:
        for sample in result.samples:
            samples.setdefault(sample.seq_id, []).append(sample)
    hf = hf_gguf_model(name)
    for seq in seqs:
        input_ids = torch.tensor([seq.prompt])
        expected = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                               max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)[0, len(seq.prompt):].tolist()
        assert seq.generated == expected, f"{name}, prompt length {len(seq.prompt)}"
        with torch.no_grad():  # teacher-forced: the distribution each of our tokens was drawn from
            logits = hf(torch.tensor([seq.tokens[:-1]])).logits[0, len(seq.prompt) - 1:]
        hf_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [MAX_NEW_TOKENS, vocab]
        for step, sample in enumerate(samples[seq.seq_id]):
            expected_top = hf_logprobs[step].topk(NUM_LOGPROBS)
            assert sample.top_token_ids == expected_top.indices.tolist()
            assert sample.top_logprobs == pytest.approx(expected_top.values.tolist(), abs=1e-4)


def test_slices_stay_available_as_blocks_for_quantized_layers(gguf_model):
    """What a quantized layer would take instead of dequantized weights: this rank's blocks, q/k rows
    already in Hugging Face order, unpacked to int4/int8 groups."""
    path = gguf_model("llama-mixed")
    model = _load(path)
    checkpoint = GGUFCheckpoint(path)
    params = dict(model.named_parameters())
    unpack = {"Q4_0": to_int4_groups, "Q4_1": to_int4_groups, "Q8_0": to_int8_groups}
    kinds = set()
    for piece in model.checkpoint_slices():
        blocks = checkpoint.read(piece)
        if blocks.tensor_type not in unpack:
            continue
        kinds.add(blocks.tensor_type)
        groups = unpack[blocks.tensor_type](blocks)
        expected = params[piece.param_name].narrow(piece.dim, piece.dst_start, piece.length)
        assert torch.equal(groups.dequantize(), expected), piece.checkpoint_name
    assert kinds == {"Q4_0", "Q4_1", "Q8_0"}


def test_half_precision_is_the_float32_load_rounded(gguf_model):
    full = dict(_load(gguf_model("llama-mixed")).named_parameters())
    for dtype in (torch.bfloat16, torch.float16):
        for param_name, param in _load(gguf_model("llama-mixed"), dtype).named_parameters():
            assert param.dtype == dtype
            assert torch.equal(param, full[param_name].to(dtype)), param_name


def test_file_and_folder_load_alike(gguf_model):
    folder = gguf_model("qwen2-tied")
    by_folder, by_file = _load(folder), _load(folder / GGUF_FILE)
    for (name, a), (_, b) in zip(by_folder.named_parameters(), by_file.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), architecture="llama", vocab_size=512,
                                 hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                 seed=5)


def test_missing_tensor_is_named(tmp_path, llama_checkpoint):
    path = write_gguf(llama_checkpoint, tmp_path / "missing.gguf", exclude={"blk.1.ffn_up.weight"})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): blk\.1\.ffn_up\.weight"):
        _load(path)


def test_unexpected_and_misshapen_tensors_are_named(tmp_path, llama_checkpoint):
    path = write_gguf(llama_checkpoint, tmp_path / "model.gguf")
    config = LlamaModelConfig.from_folder(path)
    fewer_layers = LlamaForCausalLM(dataclasses.replace(config, num_layers=1))
    with pytest.raises(CheckpointError, match=r"9 unexpected tensor\(s\): blk\.1\.attn_k\.weight"):
        load_weights(fewer_layers, path)
    narrower = LlamaForCausalLM(dataclasses.replace(config, intermediate_size=96))
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_gate\.weight has shape \[128, 64\], "
                                              r"the model config implies \[96, 64\]"):
        load_weights(narrower, path)
