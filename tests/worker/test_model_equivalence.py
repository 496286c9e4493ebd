"""Our paged model, driven through ModelRunner step plans, must match transformers' greedy generate."""

from __future__ import annotations

import pytest
from tiny_models import CHECKPOINTS, MAX_NEW_TOKENS, make_prompts
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.worker.model_runner import ModelRunner

NUM_BLOCKS = 128


def _runner(path) -> ModelRunner:
    runner = ModelRunner(path, device="cpu", dtype="float32", block_size=16)
    runner.load()
    runner.init_cache(NUM_BLOCKS, 8)
    return runner


def _seqs(prompts) -> list[DrivenSeq]:
    return [DrivenSeq(seq_id=100 + i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS) for i, prompt in enumerate(prompts)]


def _mixes_decode_and_partial_chunk(plan) -> bool:
    has_decode = any(seq.sample is not None and seq.start_position > 0 and len(seq.token_ids) == 1
                     for seq in plan.seqs)
    return has_decode and any(seq.sample is None for seq in plan.seqs)


def _assert_matches(name, seqs, hf_greedy) -> None:
    for seq in seqs:
        expected = hf_greedy(name, seq.prompt)
        assert seq.generated == expected, f"{name}, prompt length {len(seq.prompt)}"


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_batched_prefill_then_decode_matches_hf(name, checkpoint_dir, hf_greedy):
    driver = PlanDriver(_runner(checkpoint_dir(name)), NUM_BLOCKS)
    seqs = _seqs(make_prompts(seed=1))
    driver.step([(seq, len(seq.prompt)) for seq in seqs])  # every prompt in one mixed step
    assert all(len(seq.generated) == 1 for seq in seqs)
    driver.run_to_completion(seqs)
    assert driver.step_id == MAX_NEW_TOKENS  # one prefill step, then one decode step per further token
    _assert_matches(name, seqs, hf_greedy)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "mistral-window-48"])
def test_chunked_prefill_mixed_with_decodes_matches_hf(name, checkpoint_dir, hf_greedy):
    """A 40-token budget per step: long prompts arrive in chunks while earlier sequences decode."""
    driver = PlanDriver(_runner(checkpoint_dir(name)), NUM_BLOCKS)
    seqs = _seqs(make_prompts(seed=1))
    driver.run_to_completion(seqs, token_budget=40)
    assert any(_mixes_decode_and_partial_chunk(plan) for plan in driver.plans)
    _assert_matches(name, seqs, hf_greedy)


def test_staggered_arrivals_with_freed_blocks_reused(checkpoint_dir, hf_greedy):
    """Sequences finish and free blocks that later prompts reuse (stale KV must not leak in)."""
    name = "llama-gqa-untied"
    runner = _runner(checkpoint_dir(name))
    driver = PlanDriver(runner, 40)  # too few blocks for all prompts at once
    prompts = make_prompts(seed=2, lengths=(300, 5, 64, 130, 18))
    done = []
    for prompt in prompts:
        seqs = _seqs([prompt])
        driver.run_to_completion(seqs, token_budget=96)
        driver.free(seqs[0])
        done += seqs
    assert len(driver.free_blocks) == 40
    _assert_matches(name, done, hf_greedy)
