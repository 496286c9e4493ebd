"""Greedy tokens through the real processes equal Hugging Face transformers `generate`."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import VOCAB_SIZE, start_server
from tests.e2e.harness import token_request

PROMPT_LENGTHS = [1, 7, 16, 17, 33, 64, 150, 300]
MAX_NEW_TOKENS = 24


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENGTHS]


def _check_concurrent_greedy(server, checkpoint, hf_reference, seed: int) -> None:
    prompts = _prompts(seed)
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(
            lambda ids: server.stub.Generate(token_request(ids, max_tokens=MAX_NEW_TOKENS),
                                             timeout=120), prompts))
    for prompt, response in zip(prompts, responses):
        expected = hf_reference(checkpoint, prompt, MAX_NEW_TOKENS)
        completion = response.completions[0]
        assert list(completion.token_ids) == expected, f"prompt of {len(prompt)} tokens"
        assert response.usage.prompt_tokens == len(prompt)
        assert response.usage.completion_tokens == len(expected)


def test_llama_gqa_greedy_matches_hf(llama_server, llama_checkpoint, hf_reference):
    _check_concurrent_greedy(llama_server, llama_checkpoint, hf_reference, seed=0)


def test_qwen2_qkv_bias_greedy_matches_hf(qwen2_checkpoint, hf_reference, tmp_path_factory):
    server = start_server(qwen2_checkpoint, tmp_path_factory, "qwen2", "--num-kv-blocks", "200",
                          "--max-num-batched-tokens", "256")
    try:
        _check_concurrent_greedy(server, qwen2_checkpoint, hf_reference, seed=1)
        stats = server.wait_idle()
        assert stats.num_gpu_blocks_used == 0
    finally:
        assert server.stop() == 0, server.logs()[-3000:]


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_short_generations(llama_server, llama_checkpoint, hf_reference, max_tokens):
    prompt = _prompts(5)[3]
    response = llama_server.stub.Generate(token_request(prompt, max_tokens=max_tokens), timeout=60)
    assert list(response.completions[0].token_ids) == hf_reference(llama_checkpoint, prompt,
                                                                   max_tokens)
