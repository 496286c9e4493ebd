"""LoRA adapters under `serve` with n-gram speculation, KV pressure and a killed worker.

One tree, --max-loras 2, three adapters and the base, --speculative-method ngram and a pool too
small for the requests at once: every request's greedy tokens equal its merged reference while
groups are preempted and proposals verified; then a worker killed mid-stream comes back with
empty slots, the scheduler loads the adapters again, and the streams complete unchanged.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.testing.lora_adapters import build_peft_adapter, greedy, merged_model
from tests.e2e.conftest import build_checkpoint, start_server
from tests.e2e.harness import token_request, wait_for

NAMES = ["a0", "a1", "a2"]
PROMPTS = [[7 + i, 40, 41, 42 + 3 * i] * (3 + i) for i in range(3)]  # repetitive: n-gram proposals
MAX_TOKENS = 96  # prompt + output: up to 8 blocks of 16; three such requests overfill the pool of 16
KILL_MAX_TOKENS = 150  # long enough to be running at the kill; prompt + output fit the pool (11 blocks)
KILL_JOBS = [(0, "a0"), (1, "a1"), (2, None)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = build_checkpoint(tmp_path_factory.mktemp("lora-res-base"), "llama", hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=1024,
                            tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("lora-res-adapters")
    adapters = {name: build_peft_adapter(base, root / name, seed=600 + i) for i, name in enumerate(NAMES)}
    models = {name: merged_model(base, adapters.get(name)) for name in [None, *NAMES]}
    expected = {(index, name): greedy(models[name], prompt, MAX_TOKENS)
                for index, prompt in enumerate(PROMPTS) for name in [None, *NAMES]}
    long = {job: greedy(models[job[1]], PROMPTS[job[0]], KILL_MAX_TOKENS) for job in KILL_JOBS}
    return base, adapters, expected, long


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    base, adapters, _, _ = setup
    server = start_server(base, tmp_path_factory, "lora-resilience", "--enable-lora", "--lora-modules",
                          *[f"{name}={adapters[name]}" for name in NAMES], "--max-loras", "2",
                          "--max-lora-rank", "8", "--speculative-method", "ngram", "--num-kv-blocks", "16",
                          "--max-num-batched-tokens", "256", metrics=True)
    yield server
    assert server.stop() == 0, server.logs()[-3000:]


def _counter(server, name: str) -> float:
    return sum(float(value) for value in
               re.findall(rf"^{name}_total(?:{{[^}}]*}})? (\S+)$", server.metrics("scheduler"), re.MULTILINE))


def _request(index: int, adapter: str | None, max_tokens: int = MAX_TOKENS):
    request = token_request(PROMPTS[index], max_tokens=max_tokens, ignore_eos=True)
    request.adapter = adapter or ""
    return request


def test_speculation_and_preemption_keep_every_adapter_exact(setup, server):
    _, _, expected, _ = setup
    jobs = list(expected)
    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(lambda job: server.stub.Generate(_request(*job), timeout=300), jobs))
    for job, response in zip(jobs, responses):
        assert list(response.completions[0].token_ids) == expected[job], job
    assert _counter(server, "pagedserve_preemptions") > 0
    assert _counter(server, "pagedserve_spec_decode_num_drafts") > 0
    assert _counter(server, "pagedserve_lora_adapter_evictions") > 0


def test_killed_worker_reloads_adapters_and_streams_complete(setup, server):
    _, _, _, expected = setup
    jobs = KILL_JOBS
    received: list[list[int]] = [[] for _ in jobs]
    errors: list[Exception] = []

    def stream(slot: int) -> None:
        try:
            for message in server.stub.GenerateStream(_request(*jobs[slot], KILL_MAX_TOKENS), timeout=300):
                for completion in message.completions:
                    received[slot].extend(completion.token_ids)
        except Exception as exc:
            errors.append(exc)

    old_worker = server.child_pids()["worker-0"]
    loads_before = _counter(server, "pagedserve_lora_adapter_loads")
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: len(received[0]) >= 3, timeout=120)  # the a0 stream is running
    os.kill(old_worker, signal.SIGKILL)
    assert len(received[0]) < KILL_MAX_TOKENS, "the a0 stream finished before the kill"
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    assert _counter(server, "pagedserve_lora_adapter_loads") > loads_before  # the new worker's slots were filled
    for job, tokens in zip(jobs, received):
        assert tokens == expected[job], job
    assert server.child_pids()["worker-0"] != old_worker
    assert any(event.get("event") == "requests_resumed" for event in server.log_events())
