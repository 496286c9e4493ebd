"""n-gram speculative decoding through the real processes: greedy tokens equal Hugging Face's
under swap and recompute preemption, chunked prefill and prefix-cache hits, parallel seeded
samples equal those of a server without speculation, and the spec-decode metrics add up."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import VOCAB_SIZE, build_checkpoint, start_server
from tests.e2e.harness import PAUSE_ARGS, token_request

MAX_TOKENS = 40
SPEC_ARGS = ("--speculative-method", "ngram", "--num-speculative-tokens", "4", "--ngram-min", "1",
             "--ngram-max", "3", "--speculative-disable-batch-size", "64")


def _prompts() -> list[list[int]]:
    """Repetitive prompts (proposals from the prompt), random ones (from the output's own loops)
    and two that share a 48-token prefix (a prefix-cache hit for the later one)."""
    rng = random.Random(14)
    shared = [rng.randrange(4, VOCAB_SIZE) for _ in range(48)]
    prompts = []
    for length in (12, 30, 57, 90):
        motif = [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randrange(3, 9))]
        prompts.append((motif * (length // len(motif) + 1))[:length])
    prompts += [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in (17, 64, 130)]
    prompts += [shared + [5, 6, 7], shared + [8, 9]]
    return prompts


def _generate_all(server, prompts: list[list[int]]) -> list[list[int]]:
    """The two shared-prefix prompts one after the other (the second hits the cache), then the
    others all queued before their second step, whatever the speed of the host: they are submitted
    while the workers are paused, one at a time in a fixed order (longest first: its prefill alone
    fills the first step's token budget), so every run schedules the same steps. The pool is too
    small for all of them (their prompts alone need 28 blocks of 16 tokens, the tests' pools hold
    22): preemption."""
    def generate(prompt: list[int], request_id: str = "") -> list[int]:
        request = token_request(prompt, max_tokens=MAX_TOKENS)
        request.request_id = request_id
        response = server.stub.Generate(request, timeout=300)
        return list(response.completions[0].token_ids)

    shared = [generate(prompts[-2]), generate(prompts[-1])]
    burst = prompts[:-2]
    futures = {}
    with ThreadPoolExecutor(len(burst)) as pool, server.workers_paused():
        for index in sorted(range(len(burst)), key=lambda index: -len(burst[index])):
            futures[index] = pool.submit(generate, burst[index], f"burst-{index}")
            server.wait_submitted(f"burst-{index}")
    return [futures[index].result() for index in range(len(burst))] + shared


def _counter(text: str, name: str) -> float:
    return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_ngram_speculation_gives_hf_greedy_tokens_under_pressure(mode, llama_checkpoint, hf_reference,
                                                                 tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, f"spec-{mode}", *SPEC_ARGS, *PAUSE_ARGS,
                          "--num-kv-blocks", "22", "--preemption-mode", mode, "--max-num-batched-tokens", "48", "--max-num-seqs", "16",
                          metrics=True)
    try:
        prompts = _prompts()
        outputs = _generate_all(server, prompts)
        stats = server.wait_idle()
        metrics = server.metrics("scheduler")
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
    for prompt, output in zip(prompts, outputs):
        assert output == hf_reference(llama_checkpoint, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    assert stats.num_gpu_blocks_used == 0 and stats.is_pool_consistent
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0
    assert stats.num_prefix_cache_hits > 0
    drafts = _counter(metrics, "pagedserve_spec_decode_num_drafts_total")
    proposed = _counter(metrics, "pagedserve_spec_decode_draft_tokens_total")
    accepted = _counter(metrics, "pagedserve_spec_decode_accepted_tokens_total")
    per_position = _counter(metrics, "pagedserve_spec_decode_accepted_tokens_per_position_total")
    assert 0 < drafts <= proposed and 0 < accepted <= proposed
    assert per_position == accepted


def test_parallel_seeded_samples_are_the_same_with_and_without_speculation(llama_checkpoint, tmp_path_factory):
    rng = random.Random(3)
    motif = [rng.randrange(4, VOCAB_SIZE) for _ in range(5)]
    prompt = motif * 8
    request = dict(max_tokens=30, n=3, temperature=0.8, top_k=20, seed=77, repetition_penalty=1.1)
    outputs = []
    for name, args in (("plain", ()), ("spec-n3", SPEC_ARGS)):
        server = start_server(llama_checkpoint, tmp_path_factory, name, *args, "--num-kv-blocks", "64",
                              metrics=True)
        try:
            response = server.stub.Generate(token_request(prompt, **request), timeout=300)
            server.stub.Generate(token_request(prompt, max_tokens=4, beam_width=2), timeout=300)
            metrics = server.metrics("scheduler")
        finally:
            assert server.stop() == 0, server.logs()[-3000:]
        outputs.append({c.index: list(c.token_ids) for c in response.completions})
        if args:  # beam search is served without speculation, and says so
            assert _counter(metrics, "pagedserve_spec_decode_num_drafts_total") > 0
            assert _counter(metrics, "pagedserve_spec_decode_unspeculated_requests_total") == 1
            assert "speculation_not_applied" in server.logs()
    assert outputs[0] == outputs[1]
    assert len(set(map(tuple, outputs[0].values()))) > 1  # the samples differ from each other


def test_ngram_speculation_with_two_tensor_parallel_ranks_gives_hf_greedy_tokens(hf_reference, tmp_path_factory):
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("spec-tp"), "qwen2", hidden_size=64, num_layers=2,
                                  num_heads=4, num_kv_heads=2, intermediate_size=128,
                                  max_position_embeddings=1024, tie_word_embeddings=True)
    server = start_server(checkpoint, tmp_path_factory, "spec-tp2", *SPEC_ARGS, "--tensor-parallel-size", "2",
                          "--num-kv-blocks", "128", metrics=True)
    try:
        prompts = _prompts()[:5]
        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(lambda p: server.stub.Generate(token_request(p, max_tokens=MAX_TOKENS),
                                                                     timeout=300), prompts))
        metrics = server.metrics("scheduler")
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
    for prompt, response in zip(prompts, responses):
        assert list(response.completions[0].token_ids) == hf_reference(checkpoint, prompt, MAX_TOKENS)
    assert _counter(metrics, "pagedserve_spec_decode_accepted_tokens_total") > 0
