"""Tensor parallelism on CPU: two gloo ranks, each loading only its slices, must match HF greedy.

The checkpoint has one KV head (replicated on both ranks) and a vocabulary of 509 (padded to
2 x 255 rows), so both uneven cases of the split are exercised.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import MAX_NEW_TOKENS, make_prompts

from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint

WORLD_SIZE = 2
VOCAB_SIZE = 509
PROMPT_LENGTHS = (3, 17, 40, 90)


def _rank_main(rank: int, folder: str, init_file: str, prompts: list[list[int]], out_file: str,
               runner_options: dict | None = None) -> None:
    from plan_driver import DrivenSeq, tensor_parallel_rank

    with tensor_parallel_rank(folder, rank, WORLD_SIZE, init_file, num_blocks=48,
                              **(runner_options or {})) as (runner, driver):
        seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS) for i, prompt in enumerate(prompts)]
        driver.run_to_completion(seqs, token_budget=64)
        attention = runner.model.layers[0].self_attn
        report = {"generated": [seq.generated for seq in seqs], "num_heads": attention.num_heads,
                  "num_kv_heads": attention.num_kv_heads, "vocab_rows": runner.model.embed_tokens.weight.shape[0],
                  "samples_returned": sum(len(result.samples) for result in driver.results)}
        with open(f"{out_file}.{rank}", "w") as handle:
            json.dump(report, handle)


@pytest.fixture(scope="module")
def mqa_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama-mqa"), architecture="llama", vocab_size=VOCAB_SIZE,
                                 hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=128,
                                 max_position_embeddings=256, seed=21)


def test_two_ranks_match_hf_greedy(mqa_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = [[token % VOCAB_SIZE for token in prompt] for prompt in make_prompts(seed=5, lengths=PROMPT_LENGTHS)]
    out_file = str(tmp_path / "report")
    mp.spawn(_rank_main, args=(str(mqa_checkpoint), str(tmp_path / "rendezvous"), prompts, out_file),
             nprocs=WORLD_SIZE, join=True)
    reports = [json.loads(open(f"{out_file}.{rank}").read()) for rank in range(WORLD_SIZE)]
    model = AutoModelForCausalLM.from_pretrained(mqa_checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for prompt, generated in zip(prompts, reports[0]["generated"]):
        input_ids = torch.tensor([prompt])
        expected = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                  max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
        assert generated == expected, f"prompt length {len(prompt)}"
    assert reports[1]["generated"] == reports[0]["generated"]
    assert [r["num_heads"] for r in reports] == [2, 2] and [r["num_kv_heads"] for r in reports] == [1, 1]
    assert [r["vocab_rows"] for r in reports] == [255, 255]
    assert reports[0]["samples_returned"] > 0 and reports[1]["samples_returned"] == 0


def test_two_ranks_int4_match_one_rank(mqa_checkpoint, tmp_path, monkeypatch):
    """int4 groups of 32 never straddle a shard here, so both ranks quantize exactly the groups one
    rank would: with the float32 reference kernels the greedy tokens are the single rank's."""
    from plan_driver import DrivenSeq, PlanDriver

    from pagedserve.kernels import ops
    from pagedserve.worker.model_runner import ModelRunner

    monkeypatch.setenv(ops.KERNELS_ENV, "reference")  # inherited by the spawned ranks
    options = {"quantization": "int4", "quantization_group_size": 32}
    prompts = [[token % VOCAB_SIZE for token in prompt] for prompt in make_prompts(seed=6, lengths=PROMPT_LENGTHS)]
    out_file = str(tmp_path / "report")
    mp.spawn(_rank_main, args=(str(mqa_checkpoint), str(tmp_path / "rendezvous"), prompts, out_file, options),
             nprocs=WORLD_SIZE, join=True)
    report = json.loads(open(f"{out_file}.0").read())
    runner = ModelRunner(mqa_checkpoint, device="cpu", dtype="float32", block_size=16, **options)
    runner.load()
    runner.init_cache(48, 0)
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS) for i, prompt in enumerate(prompts)]
    PlanDriver(runner, 48).run_to_completion(seqs, token_budget=64)
    assert report["generated"] == [seq.generated for seq in seqs]
