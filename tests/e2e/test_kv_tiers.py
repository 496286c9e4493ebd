"""The KV tiers end to end (real `serve` processes, float32 toy model, small device pool): a
2,000-token prefix evicted from the device pool by other load comes back from the host tier with
the cold run's greedy tokens; a restarted `serve` on the same --kv-cache-dir finds it on disk;
another block size reuses nothing."""

from __future__ import annotations

import os
import random
import re
import signal
import threading

import pytest

from tests.e2e.conftest import build_checkpoint, start_server
from tests.e2e.harness import stream_tokens, token_request, wait_for

PREFIX_TOKENS = 2000
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama-long"), "llama", hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=4096,
                            tie_word_embeddings=False)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(PREFIX_TOKENS)]


def _generate(server, prompt: list[int]) -> tuple[list[int], int]:
    response = server.stub.Generate(token_request(prompt, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=300)
    return list(response.completions[0].token_ids), response.usage.cached_prompt_tokens


def _counter(text: str, name: str, **labels) -> float:
    selector = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    match = re.search(rf"^{name}\{{{selector}\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_prefix_survives_eviction_and_restart(long_checkpoint, tmp_path, tmp_path_factory) -> None:
    shared = _prompt(1)
    tiers = ("--num-kv-blocks", "160", "--kv-offloading-size", "0.05", "--kv-cache-dir", str(tmp_path))
    server = start_server(long_checkpoint, tmp_path_factory, "tiers", *tiers, metrics=True)
    try:
        cold, cached = _generate(server, shared)
        assert cached == 0
        _generate(server, _prompt(2))  # other load: the device pool evicts most of the prefix
        warm, cached = _generate(server, shared)
        assert cached >= 1984
        assert warm == cold
        metrics = server.metrics("scheduler")
        assert _counter(metrics, "pagedserve_kv_tier_hits_total", tier="host") > 0
        assert _counter(metrics, "pagedserve_kv_tier_bytes_total", tier="host", direction="write") > 0
        assert _counter(metrics, "pagedserve_kv_tier_bytes_total", tier="disk", direction="write") > 0
    finally:
        assert server.stop() == 0

    restarted = start_server(long_checkpoint, tmp_path_factory, "tiers-restarted", *tiers, metrics=True)
    try:
        again, cached = _generate(restarted, shared)
        assert cached >= 1984
        assert again == cold
        assert _counter(restarted.metrics("scheduler"), "pagedserve_kv_tier_hits_total", tier="disk") >= 100
    finally:
        assert restarted.stop() == 0

    other = start_server(long_checkpoint, tmp_path_factory, "tiers-other-layout", "--block-size", "32", *tiers)
    try:
        _, cached = _generate(other, shared)
        assert cached == 0
    finally:
        assert other.stop() == 0


def test_a_worker_killed_while_writing_block_files(long_checkpoint, tmp_path, tmp_path_factory) -> None:
    """A worker killed mid-stream, with block files still queued for its writer: serve restarts it,
    the stream completes with the tokens of an undisturbed run, and every prompt asked again (its
    blocks from disk where the files made it, computed where not) gives its cold tokens."""
    tiers = ("--num-kv-blocks", "160", "--kv-offloading-size", "0.05", "--kv-cache-dir", str(tmp_path))
    server = start_server(long_checkpoint, tmp_path_factory, "tiers-crash", *tiers)
    try:
        prompts = [_prompt(10 + index) for index in range(2)]
        cold = [_generate(server, prompt)[0] for prompt in prompts]
        streamed = _prompt(20)
        undisturbed = list(server.stub.Generate(token_request(streamed, max_tokens=120, ignore_eos=True),
                                                timeout=300).completions[0].token_ids)
        _generate(server, _prompt(21))  # evicts the streamed prompt's blocks from the device pool
        old_worker = server.child_pids()["worker-0"]
        received: list[int] = []
        errors: list[Exception] = []
        thread = threading.Thread(target=stream_tokens, args=(server, _prompt(22), [], []),
                                  kwargs={"max_tokens": 4})
        thread.start()  # a fresh prompt: its blocks are being written when the worker dies
        streaming = threading.Thread(target=stream_tokens, args=(server, streamed, received, errors),
                                     kwargs={"max_tokens": 120})
        streaming.start()
        assert wait_for(lambda: len(received) >= 2, timeout=120)
        os.kill(old_worker, signal.SIGKILL)
        streaming.join(300)
        thread.join(300)
        assert not errors, errors
        assert received == undisturbed
        assert server.child_pids()["worker-0"] != old_worker
        for prompt, tokens in zip(prompts, cold):
            assert _generate(server, prompt)[0] == tokens
    finally:
        assert server.stop() == 0


def test_tensor_parallel_ranks_write_and_read_their_shards(long_checkpoint, tmp_path, tmp_path_factory) -> None:
    """With two ranks every block has a file per rank (its KV heads); a restart reads both."""
    prompt = _prompt(30)[:512]
    tiers = ("--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--kv-cache-dir", str(tmp_path))
    server = start_server(long_checkpoint, tmp_path_factory, "tiers-tp", *tiers)
    try:
        cold, _ = _generate(server, prompt)
    finally:
        assert server.stop() == 0
    (folder,) = [entry for entry in tmp_path.iterdir() if entry.is_dir()]
    names = os.listdir(folder)
    assert {name.split(".")[1] for name in names} == {"r0", "r1"}
    assert len([name for name in names if ".r0." in name]) == len([name for name in names if ".r1." in name]) >= 31
    restarted = start_server(long_checkpoint, tmp_path_factory, "tiers-tp-restarted", *tiers)
    try:
        again, cached = _generate(restarted, prompt)
        assert cached == 496 and again == cold
    finally:
        assert restarted.stop() == 0
