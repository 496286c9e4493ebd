"""GGUF under tensor parallelism: each of two gloo ranks reads only its slices, which must equal the
matching slices of a one-rank load, and together they decode like transformers' GGUF model.

intermediate_size 96 splits the down projection's 96 columns into 48 per rank, which is not a
whole number of 32-value blocks: that rank's columns are decoded, then cut. The o projection's 32
columns per rank are cut between blocks. A vocabulary of 509 pads the last rank's embedding rows.
With --quantization auto on a file whose linear layers are all Q4 in whole blocks per rank, each
rank packs its own slice and the two ranks decode like one.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import make_prompts
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.testing.tiny_gguf import write_gguf
from pagedserve.kernels.linear.block_quant import BlockQuantWeight
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.worker.model_runner import ModelRunner

WORLD_SIZE = 2
VOCAB_SIZE = 509
MAX_NEW_TOKENS = 8
TENSOR_TYPES = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0",
                "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "F16", "ffn_down": "Q4_1", "output.": "Q8_0"}


def _rank_main(rank: int, path: str, init_file: str, prompts: list[list[int]], out_file: str,
               quantization: str = "none") -> None:
    from plan_driver import tensor_parallel_rank

    with tensor_parallel_rank(path, rank, WORLD_SIZE, init_file, num_blocks=32,
                              quantization=quantization) as (runner, driver):
        seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS) for i, prompt in enumerate(prompts)]
        driver.run_to_completion(seqs)
        torch.save({name: param.detach() for name, param in runner.model.named_parameters()}, f"{out_file}.{rank}.pt")
        with open(f"{out_file}.{rank}.json", "w") as handle:
            json.dump([seq.generated for seq in seqs], handle)


@pytest.fixture(scope="module")
def tp_gguf(tmp_path_factory):
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("tp-checkpoint"), architecture="llama",
                                       vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=2, num_heads=4,
                                       num_kv_heads=2, intermediate_size=96, max_position_embeddings=256, seed=41)
    return write_gguf(checkpoint, tmp_path_factory.mktemp("tp") / "model.gguf", tensor_types=TENSOR_TYPES)


def test_two_ranks_load_their_slices_and_match_transformers(tp_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    from pagedserve.worker.loading.hf_checkpoint import load_weights
    from pagedserve.worker.models.llama import LlamaForCausalLM
    from pagedserve.worker.models.llama_config import LlamaModelConfig

    prompts = [[token % VOCAB_SIZE for token in prompt] for prompt in make_prompts(seed=6, lengths=(5, 33))]
    out_file = str(tmp_path / "rank")
    mp.spawn(_rank_main, args=(str(tp_gguf), str(tmp_path / "rendezvous"), prompts, out_file),
             nprocs=WORLD_SIZE, join=True)
    full = LlamaForCausalLM(LlamaModelConfig.from_folder(tp_gguf))
    load_weights(full, tp_gguf)
    whole = dict(full.named_parameters())
    ranks = [torch.load(f"{out_file}.{rank}.pt") for rank in range(WORLD_SIZE)]
    q, kv = 64, 32  # rows of q and of k (or v) in the whole model
    for layer in range(2):
        prefix = f"layers.{layer}"
        qkv = whole[f"{prefix}.self_attn.qkv_proj.weight"]
        for rank, params in enumerate(ranks):
            expected_qkv = torch.cat([qkv[rank * q // 2:(rank + 1) * q // 2],
                                      qkv[q + rank * kv // 2:q + (rank + 1) * kv // 2],
                                      qkv[q + kv + rank * kv // 2:q + kv + (rank + 1) * kv // 2]])
            assert torch.equal(params[f"{prefix}.self_attn.qkv_proj.weight"], expected_qkv)
            o_proj = whole[f"{prefix}.self_attn.o_proj.weight"]
            assert torch.equal(params[f"{prefix}.self_attn.o_proj.weight"], o_proj[:, rank * 32:(rank + 1) * 32])
            down = whole[f"{prefix}.mlp.down_proj.weight"]
            assert torch.equal(params[f"{prefix}.mlp.down_proj.weight"], down[:, rank * 48:(rank + 1) * 48])
            gate_up = whole[f"{prefix}.mlp.gate_up_proj.weight"]
            expected_gate_up = torch.cat([gate_up[rank * 48:(rank + 1) * 48], gate_up[96 + rank * 48:96 + (rank + 1) * 48]])
            assert torch.equal(params[f"{prefix}.mlp.gate_up_proj.weight"], expected_gate_up)
    embedding = whole["embed_tokens.weight"]
    assert torch.equal(ranks[0]["embed_tokens.weight"], embedding[:255])
    assert torch.equal(ranks[1]["embed_tokens.weight"][:254], embedding[255:])
    generated = [json.loads(open(f"{out_file}.{rank}.json").read()) for rank in range(WORLD_SIZE)]
    assert generated[0] == generated[1]
    hf = AutoModelForCausalLM.from_pretrained(tp_gguf.parent, gguf_file=tp_gguf.name, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, generated[0]):
        input_ids = torch.tensor([prompt])
        expected = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                               max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0, eos_token_id=None)
        assert tokens == expected[0, len(prompt):].tolist()


# every linear layer Q4 and each rank's slice whole blocks: q/k/v and gate/up rows split, o's 64
# columns 32 per rank, down's 128 columns 64 per rank
PACKED_TYPES = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0",
                "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_1", "output.": "Q8_0"}


def test_two_ranks_keep_their_slices_quantized_and_decode_like_one(tmp_path):
    """--quantization auto under tensor parallelism: each rank packs its own blocks (the packed
    codes of its slice are the one-rank load's), and the two ranks generate the one-rank tokens."""
    checkpoint = build_tiny_checkpoint(tmp_path / "checkpoint", architecture="llama", vocab_size=512,
                                       hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                       max_position_embeddings=256, seed=42)
    path = write_gguf(checkpoint, tmp_path / "model.gguf", tensor_types=PACKED_TYPES)
    prompts = [[token % 512 for token in prompt] for prompt in make_prompts(seed=7, lengths=(5, 33))]
    out_file = str(tmp_path / "rank")
    mp.spawn(_rank_main, args=(str(path), str(tmp_path / "rendezvous"), prompts, out_file, "auto"),
             nprocs=WORLD_SIZE, join=True)
    ranks = [torch.load(f"{out_file}.{rank}.pt") for rank in range(WORLD_SIZE)]
    one = ModelRunner(path, device="cpu", dtype="float32", quantization="auto")
    one.load()
    for rank, params in enumerate(ranks):
        assert "layers.0.mlp.down_proj.weight" not in params and "layers.0.mlp.down_proj.weight_qs" in params
        down = one.model.layers[0].mlp.down_proj.packed.dequantize()  # [64, 128]
        local = params["layers.0.mlp.down_proj.weight_scales"]  # [64, groups] of this rank's inputs
        assert local.shape[1] == 2  # 64 inputs in groups of 32
        packed = BlockQuantWeight(params["layers.0.mlp.down_proj.weight_qs"], local,
                                  params["layers.0.mlp.down_proj.weight_mins"], 4)
        assert torch.equal(packed.dequantize(), down[:, rank * 64:(rank + 1) * 64])
    generated = [json.loads(open(f"{out_file}.{rank}.json").read()) for rank in range(WORLD_SIZE)]
    assert generated[0] == generated[1]
    one.init_cache(32, 0)
    driver = PlanDriver(one, 32)
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS) for i, prompt in enumerate(prompts)]
    driver.run_to_completion(seqs)
    assert generated[0] == [seq.generated for seq in seqs]
