"""--scheduling-policy priority on a real `serve`: under a flood of priority-10 streams that
keeps every running slot taken (--max-num-seqs 2) and the waiting queue full, a priority-0
request preempts one of them and its time to first token stays under twice its idle value,
measured in the same test; without the policy it would wait for a slot. The priority-0 prompts are
long enough that their prefill, not process wake-ups on a busy host, dominates the TTFT."""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import pytest

from tests.e2e.conftest import start_server
from tests.e2e.harness import assert_pool_whole, token_request, wait_for

NUM_FLOOD_STREAMS = 8
NUM_SAMPLES = 5
PROMPT_LEN = 768
_PROMPT_SEEDS = itertools.count()  # each sample's first token differs: no prefix-cache hits


@pytest.fixture(scope="module")
def priority_server(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "priority", "--scheduling-policy", "priority",
                          "--max-num-seqs", "2", "--num-kv-blocks", "256", "--max-num-batched-tokens", "512")
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


def _ttft(server, prompt: list[int], priority: int) -> float:
    request = token_request(prompt, max_tokens=2, ignore_eos=True)
    request.priority = priority
    started = time.perf_counter()
    stream = server.stub.GenerateStream(request, timeout=120)
    first = next(stream)
    elapsed = time.perf_counter() - started
    assert first.completions[0].token_ids
    for _ in stream:
        pass
    return elapsed


def _median_ttft(server, priority: int) -> float:
    return statistics.median(_ttft(server, [3 + next(_PROMPT_SEEDS)] + [7] * (PROMPT_LEN - 1), priority)
                             for _ in range(NUM_SAMPLES))


def test_priority_zero_keeps_its_ttft_under_a_flood_of_priority_ten(priority_server):
    server = priority_server
    _median_ttft(server, 0)  # warm up
    idle_ttft = _median_ttft(server, 0)

    stop = threading.Event()
    errors: list[Exception] = []

    def flood(index: int) -> None:
        while not stop.is_set():
            request = token_request([100 + index, 101, 102, 103], max_tokens=60, ignore_eos=True)
            request.priority = 10
            try:
                for _ in server.stub.GenerateStream(request, timeout=120):
                    if stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)
                return

    threads = [threading.Thread(target=flood, args=(index,), daemon=True) for index in range(NUM_FLOOD_STREAMS)]
    for thread in threads:
        thread.start()
    try:
        assert wait_for(lambda: server.stats().num_waiting >= NUM_FLOOD_STREAMS - 2, timeout=30), \
            "the flood did not saturate the scheduler"
        preemptions_before = server.stats().num_preemptions_recompute + server.stats().num_preemptions_swap
        loaded_ttft = _median_ttft(server, 0)
        stats = server.stats()
        assert stats.num_waiting >= 1  # still saturated after the samples
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > preemptions_before
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors
    print(f"priority 0 TTFT: idle {idle_ttft * 1e3:.1f} ms, under the flood {loaded_ttft * 1e3:.1f} ms")
    assert loaded_ttft < 2 * idle_ttft, f"TTFT idle {idle_ttft * 1e3:.1f} ms, under the flood {loaded_ttft * 1e3:.1f} ms"
    assert_pool_whole(server)
