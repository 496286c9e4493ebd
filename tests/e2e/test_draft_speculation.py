"""Draft-model speculative decoding through the real processes: greedy tokens equal Hugging Face's
with the target itself as the draft (every proposal right: bonus tokens, the draft's catch-up of
its last proposal) and with a one-layer draft (most proposals wrong), under swap and recompute
preemption, chunked prefill, prefix-cache hits and two tensor-parallel ranks; seeded samples do
not depend on their batch; serve refuses inconsistent draft flags."""

from __future__ import annotations

import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import VOCAB_SIZE, build_checkpoint, start_server
from tests.e2e.harness import PAUSE_ARGS, token_request
from tests.e2e.test_speculative import MAX_TOKENS, _counter, _generate_all, _prompts


def _draft_args(draft, *extra: str) -> tuple[str, ...]:
    return ("--speculative-method", "draft", "--speculative-model", str(draft), "--num-speculative-tokens", "3",
            "--speculative-disable-batch-size", "64", *extra)


def _spec_counts(metrics: str) -> tuple[float, float, float]:
    return (_counter(metrics, "pagedserve_spec_decode_num_drafts_total"),
            _counter(metrics, "pagedserve_spec_decode_draft_tokens_total"),
            _counter(metrics, "pagedserve_spec_decode_accepted_tokens_total"))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_self_draft_gives_hf_greedy_tokens_under_pressure(mode, llama_checkpoint, hf_reference, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, f"draft-{mode}", *_draft_args(llama_checkpoint), *PAUSE_ARGS,
                          "--num-kv-blocks", "22", "--preemption-mode", mode, "--max-num-batched-tokens", "48",
                          "--max-num-seqs", "16", metrics=True)
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
    drafts, proposed, accepted = _spec_counts(metrics)
    assert 0 < drafts <= proposed and 0 < accepted <= proposed
    assert accepted >= 0.9 * proposed  # the draft is the target: only batch-shape rounding can disagree


def test_one_layer_draft_with_chunked_prefill_gives_hf_greedy_tokens(llama_checkpoint, hf_reference,
                                                                     tmp_path_factory):
    draft = build_checkpoint(tmp_path_factory.mktemp("draft-1-layer"), "llama", hidden_size=64, num_layers=1,
                             num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=1024,
                             tie_word_embeddings=False)
    server = start_server(llama_checkpoint, tmp_path_factory, "draft-1-layer", *_draft_args(draft), *PAUSE_ARGS,
                          "--num-kv-blocks", "96", "--max-num-batched-tokens", "32", "--max-num-seqs", "16",
                          metrics=True)
    try:
        prompts = _prompts()
        outputs = _generate_all(server, prompts)
        metrics = server.metrics("scheduler")
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
    for prompt, output in zip(prompts, outputs):
        assert output == hf_reference(llama_checkpoint, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    drafts, proposed, accepted = _spec_counts(metrics)
    assert 0 < drafts <= proposed and accepted <= proposed


def test_draft_with_two_tensor_parallel_ranks_gives_hf_greedy_tokens(qwen2_checkpoint, hf_reference,
                                                                     tmp_path_factory):
    server = start_server(qwen2_checkpoint, tmp_path_factory, "draft-tp2", *_draft_args(qwen2_checkpoint),
                          "--tensor-parallel-size", "2", "--num-kv-blocks", "128", metrics=True)
    try:
        prompts = _prompts()[:5]
        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(lambda p: server.stub.Generate(token_request(p, max_tokens=MAX_TOKENS),
                                                                     timeout=300), prompts))
        metrics = server.metrics("scheduler")
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
    for prompt, response in zip(prompts, responses):
        assert list(response.completions[0].token_ids) == hf_reference(qwen2_checkpoint, prompt, MAX_TOKENS)
    assert _spec_counts(metrics)[2] > 0


def test_seeded_samples_with_a_draft_do_not_depend_on_the_batch(llama_checkpoint, tmp_path_factory):
    rng = random.Random(5)
    prompt = [rng.randrange(4, VOCAB_SIZE) for _ in range(20)]
    others = [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in (9, 33, 50)]
    request = dict(max_tokens=24, n=3, temperature=0.8, top_k=20, seed=11, repetition_penalty=1.1)
    server = start_server(llama_checkpoint, tmp_path_factory, "draft-seeded", *_draft_args(llama_checkpoint),
                          "--num-kv-blocks", "96", metrics=True)
    try:
        alone = server.stub.Generate(token_request(prompt, **request), timeout=300)
        with ThreadPoolExecutor(4) as pool:
            busy = [pool.submit(server.stub.Generate, token_request(p, max_tokens=24, temperature=1.0), timeout=300)
                    for p in others]
            batched = server.stub.Generate(token_request(prompt, **request), timeout=300)
            for future in busy:
                future.result()
        metrics = server.metrics("scheduler")
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
    tokens = [{c.index: list(c.token_ids) for c in response.completions} for response in (alone, batched)]
    assert tokens[0] == tokens[1]
    assert len(set(map(tuple, tokens[0].values()))) > 1  # the samples differ from each other
    assert _spec_counts(metrics)[1] > 0


@pytest.mark.parametrize("flags, message", [
    (("--speculative-method", "draft"), "--speculative-model"),
    (("--speculative-method", "ngram", "--speculative-model", "demo"), "--speculative-model"),
])
def test_serve_refuses_inconsistent_draft_flags(flags, message, llama_checkpoint):
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(llama_checkpoint), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
