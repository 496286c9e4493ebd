"""Paged-memory techniques through the real processes: beam search, parallel sampling, prefix
caching and preemption (swap, recompute, auto) under a deliberately small KV pool."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import VOCAB_SIZE, start_server
from tests.e2e.harness import PAUSE_ARGS, token_request

PREEMPT_PROMPT_LENGTHS = [40 + 7 * i for i in range(16)]
PREEMPT_MAX_TOKENS = 48


@pytest.fixture(scope="module")
def hf_beams(llama_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32).eval()

    def beams(prompt: list[int], k: int, max_new_tokens: int, length_penalty: float) -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k,
                                 do_sample=False, max_new_tokens=max_new_tokens,
                                 length_penalty=length_penalty,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        result = []
        for row in out[:, len(prompt):].tolist():
            ends = [i for i, token in enumerate(row) if token in eos_ids]
            result.append(row[:ends[0] + 1] if ends else row)  # HF pads finished beams with EOS
        return result

    return beams


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_matches_hf(llama_server, hf_beams, k):
    rng = random.Random(k)
    for length in (5, 37):
        prompt = [rng.randrange(4, VOCAB_SIZE) for _ in range(length)]
        response = llama_server.stub.Generate(
            token_request(prompt, beam_width=k, max_tokens=12), timeout=120)
        ours = [list(c.token_ids) for c in response.completions]
        assert [c.index for c in response.completions] == list(range(k))
        assert ours == hf_beams(prompt, k, 12, 1.0), f"prompt of {length} tokens"


def test_beam_search_streams_once_at_the_end(llama_server):
    messages = list(llama_server.stub.GenerateStream(
        token_request([9, 8, 7, 6], beam_width=2, max_tokens=6), timeout=60))
    with_tokens = [m for m in messages if any(c.token_ids for c in m.completions)]
    assert len(with_tokens) == 1
    assert len(with_tokens[0].completions) == 2


def test_parallel_sampling_returns_n_completions(llama_server):
    prompt = [10 + i % 400 for i in range(512)]
    response = llama_server.stub.Generate(
        token_request(prompt, n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
        timeout=120)
    texts = [tuple(c.token_ids) for c in response.completions]
    assert sorted(c.index for c in response.completions) == [0, 1, 2, 3]
    assert all(len(t) == 16 for t in texts)
    assert len(set(texts)) > 1, "the samples did not diverge"
    again = llama_server.stub.Generate(
        token_request(prompt, n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
        timeout=120)
    assert [tuple(c.token_ids) for c in again.completions] == texts
    assert llama_server.wait_idle().num_gpu_blocks_used == 0


def test_prefix_cache_reuses_a_long_system_prompt(llama_server, llama_checkpoint, hf_reference):
    rng = random.Random(11)
    system = [rng.randrange(4, VOCAB_SIZE) for _ in range(1000)]
    first = system + [5, 6, 7, 8, 9]
    second = system + [50, 60, 70]
    response_one = llama_server.stub.Generate(token_request(first, max_tokens=6), timeout=120)
    before = llama_server.stats()
    request = token_request(second, max_tokens=6)
    request.request_id = "prefix-second"
    response_two = llama_server.stub.Generate(request, timeout=120)
    after = llama_server.stats(max_recent_steps=64)
    cached = response_two.usage.cached_prompt_tokens
    assert cached >= 992, cached
    assert after.num_prefix_cache_hits - before.num_prefix_cache_hits >= 62
    prefill_steps = [s for s in after.recent_steps if list(s.request_ids) == ["prefix-second"]]
    computed = sum(s.num_prefill_tokens + s.num_decode_tokens for s in prefill_steps)
    # The prompt's uncached tail plus one decode token per later step: far less than the prompt.
    assert computed <= len(second) - cached + 6, computed
    assert list(response_two.completions[0].token_ids) == hf_reference(llama_checkpoint, second, 6)
    assert list(response_one.completions[0].token_ids) == hf_reference(llama_checkpoint, first, 6)


def _preemption_workload(server) -> list[list[int]]:
    """16 requests, all queued before their second step (submitted in order while the workers are
    paused): their prompts alone need 100 blocks of 16 tokens (3 to 10 each) and their 48 output
    tokens 3 more each, so on a 40-block pool the requests admitted first fill it and run out of
    blocks as they grow: preemption on every run, however fast the host is."""
    rng = random.Random(3)
    prompts = [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in PREEMPT_PROMPT_LENGTHS]

    def generate(index: int):
        request = token_request(prompts[index], max_tokens=PREEMPT_MAX_TOKENS, ignore_eos=True)
        request.request_id = f"preempt-{index}"
        return server.stub.Generate(request, timeout=300)

    with ThreadPoolExecutor(len(prompts)) as pool, server.workers_paused():
        futures = []
        for index in range(len(prompts)):
            futures.append(pool.submit(generate, index))
            server.wait_submitted(f"preempt-{index}")
    return [list(future.result().completions[0].token_ids) for future in futures]


@pytest.fixture(scope="module")
def unpressured_outputs(llama_server):
    return _preemption_workload(llama_server)


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_gives_identical_output(mode, unpressured_outputs, llama_checkpoint,
                                          tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, f"preempt-{mode}",
                          "--num-kv-blocks", "40", "--preemption-mode", mode,
                          "--no-enable-prefix-caching", *PAUSE_ARGS)
    try:
        outputs = _preemption_workload(server)
        stats = server.wait_idle()
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
    assert outputs == unpressured_outputs
    assert stats.is_pool_consistent
    assert stats.num_gpu_blocks_used == 0 and stats.num_cpu_blocks_used == 0
    if mode == "swap":
        assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute == 0
    elif mode == "recompute":
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    else:
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0


def test_request_that_can_never_fit_is_rejected(llama_checkpoint, tmp_path_factory):
    import grpc

    server = start_server(llama_checkpoint, tmp_path_factory, "tiny-pool", "--num-kv-blocks", "4")
    try:
        with pytest.raises(grpc.RpcError) as error:
            server.stub.Generate(token_request(list(range(4, 104)), max_tokens=8), timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block" in error.value.details().lower()
        ok = server.stub.Generate(token_request([5, 6, 7], max_tokens=4), timeout=30)
        assert len(ok.completions[0].token_ids) >= 1
    finally:
        assert server.stop() == 0, server.logs()[-3000:]
