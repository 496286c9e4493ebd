"""Draft-model speculation over two gloo ranks on the CPU: every rank runs its shard of the draft,
rank 0 picks the drafts and broadcasts them, and the tokens (greedy: HF's; seeded sampling) and
the drafts accepted are those of one rank. A draft whose KV heads cannot be split over the ranks is
a configuration error."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import MAX_NEW_TOKENS, make_prompts

from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.contracts.step_plan import SampleSpec

WORLD_SIZE = 2
VOCAB_SIZE = 509
SIZES = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_heads=4, num_kv_heads=1, intermediate_size=128,
             max_position_embeddings=256)
NUM_BLOCKS = 48
SEEDED = SampleSpec(temperature=0.8, top_k=50, seed=99)


def _run(runner, driver_factory, prompts: list[list[int]]) -> dict:
    from draft_driver import DraftedSeq

    seqs = [DraftedSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS) for i, prompt in enumerate(prompts)]
    seqs[-1].spec = SEEDED
    driver = driver_factory()
    driver.run_to_completion(seqs, token_budget=48, num_drafts={i: 1 + i % 4 for i in range(len(seqs))})
    return {"generated": [seq.generated[:MAX_NEW_TOKENS] for seq in seqs],
            "accepted": [seq.num_accepted for seq in seqs], "drafted": [seq.num_drafted for seq in seqs],
            "draft_kv_heads": runner.draft.model.num_kv_heads_per_rank,
            "samples_returned": sum(len(result.samples) for result in driver.results)}


def _rank_main(rank: int, folder: str, draft: str, bad_draft: str, init_file: str, prompts: list[list[int]],
               out_file: str) -> None:
    from draft_driver import DraftDriver
    from plan_driver import tensor_parallel_rank

    from pagedserve.worker.speculation.draft_model import DraftModel, DraftModelError

    with tensor_parallel_rank(folder, rank, WORLD_SIZE, init_file, num_blocks=NUM_BLOCKS,
                              speculative_model=draft) as (runner, driver):
        report = _run(runner, lambda: DraftDriver(runner, NUM_BLOCKS, share_samples=driver.share_samples), prompts)
        try:
            DraftModel(bad_draft).load(target_config=runner.config, tp=runner.model.tp, dtype=runner.dtype,
                                       device=runner.device, max_positions=64, kv_cache_dtype="auto")
            report["bad_draft_error"] = ""
        except DraftModelError as exc:
            report["bad_draft_error"] = str(exc)
        with open(f"{out_file}.{rank}", "w") as handle:
            json.dump(report, handle)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    target = build_tiny_checkpoint(tmp_path_factory.mktemp("mqa"), **SIZES, num_layers=2, seed=21)
    draft = build_tiny_checkpoint(tmp_path_factory.mktemp("mqa-draft"), **SIZES, num_layers=1, seed=21)
    bad = build_tiny_checkpoint(tmp_path_factory.mktemp("three-kv-heads"),
                                **{**SIZES, "hidden_size": 48, "num_heads": 6, "num_kv_heads": 3}, num_layers=1, seed=2)
    return target, draft, bad


def test_two_ranks_draft_and_emit_the_tokens_of_one_rank(checkpoints, tmp_path):
    from draft_driver import DraftDriver
    from transformers import AutoModelForCausalLM

    from pagedserve.worker.model_runner import ModelRunner

    target, draft, bad = checkpoints
    prompts = [[token % VOCAB_SIZE for token in prompt] for prompt in make_prompts(seed=8, lengths=(3, 17, 40, 90))]
    out_file = str(tmp_path / "report")
    mp.spawn(_rank_main, args=(str(target), str(draft), str(bad), str(tmp_path / "rendezvous"), prompts, out_file),
             nprocs=WORLD_SIZE, join=True)
    reports = [json.loads(open(f"{out_file}.{rank}").read()) for rank in range(WORLD_SIZE)]
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        runner = ModelRunner(target, device="cpu", dtype="float32", block_size=16, speculative_model=draft)
        runner.load()
        runner.init_cache(NUM_BLOCKS, 0)
        single = _run(runner, lambda: DraftDriver(runner, NUM_BLOCKS), prompts)
    finally:
        torch.set_num_threads(num_threads)
    for key in ("generated", "accepted", "drafted"):
        assert reports[0][key] == single[key] == reports[1][key], key
    assert sum(single["accepted"]) > 0
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, generated in zip(prompts[:-1], single["generated"]):  # the greedy ones
        input_ids = torch.tensor([prompt])
        expected = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                               max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
        assert generated == expected, f"prompt length {len(prompt)}"
    assert [r["draft_kv_heads"] for r in reports] == [1, 1]  # the draft's one KV head on both ranks
    assert reports[0]["samples_returned"] > 0 and reports[1]["samples_returned"] == 0
    assert all("3 KV heads cannot be split over 2 tensor-parallel ranks" in r["bad_draft_error"] for r in reports)
