"""Continuous batching, seeded sampling independence and a whole block pool after requests end."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tests.e2e.harness import WorkerStop, token_request


def _stream_timed(server, request_id: str, prompt: list[int], max_tokens: int, record: dict,
                  on_token=None) -> None:
    """Streams a request; record[request_id] is the arrival time of every token (a message may
    carry several), growing as they arrive; on_token() runs after every message."""
    request = token_request(prompt, max_tokens=max_tokens, ignore_eos=True)
    request.request_id = request_id
    times = record.setdefault(request_id, [])
    for message in server.stub.GenerateStream(request, timeout=120):
        num_tokens = sum(len(c.token_ids) for c in message.completions)
        times.extend([time.monotonic()] * num_tokens)
        if on_token is not None:
            on_token()


def test_new_request_joins_running_batch(llama_server):
    """Three long streams decode; the long stream whose message gives every long one at least
    three tokens stops the workers from its own thread (WorkerStop: on a loaded host a polling
    thread woke after a fast host's workers had decoded all 160 tokens), and the short request
    arrives while they are stopped, so the longs (150 tokens from their end) are still running
    when it is scheduled."""
    record: dict[str, list[float]] = {}
    long_ids = [f"long-{i}" for i in range(3)]
    stop_workers = WorkerStop(llama_server)

    def on_long_token() -> None:
        if all(len(record.get(rid, ())) >= 3 for rid in long_ids):
            stop_workers()

    threads = [threading.Thread(target=_stream_timed,
                                args=(llama_server, rid, [5 + i, 6, 7, 8], 160, record, on_long_token))
               for i, rid in enumerate(long_ids)]
    for thread in threads:
        thread.start()
    short = threading.Thread(target=_stream_timed, args=(llama_server, "short", [9, 10, 11], 4, record))
    try:
        assert stop_workers.stopped.wait(timeout=60), {rid: len(times) for rid, times in record.items()}
        assert all(len(record[rid]) < 160 for rid in long_ids)
        short.start()
        llama_server.wait_submitted("short")
    finally:
        stop_workers.resume()
    for thread in [*threads, short]:
        thread.join()
    short_first = record["short"][0]
    assert all(len(record[rid]) == 160 for rid in long_ids)
    assert all(short_first < record[rid][-1] for rid in long_ids), "short waited for the long ones"
    steps = llama_server.stats(max_recent_steps=256).recent_steps
    compositions = [frozenset(step.request_ids) for step in steps]
    joined = [c for c in compositions if "short" in c and c & set(long_ids)]
    assert joined, "no step batched the new request with the running ones"
    with_short = [i for i, c in enumerate(compositions) if "short" in c]
    # the batch changed twice: the short request joined running longs and left them running
    assert any(set(long_ids) <= c for c in compositions[:with_short[0]]), "no long-only step before it joined"
    assert any(set(long_ids) <= c for c in compositions[with_short[-1] + 1:]), "the longs did not run on after it"


def test_seeded_sampling_is_batch_independent(llama_server):
    prompt = [20, 21, 22, 23, 24]
    seeded = dict(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llama_server.stub.Generate(token_request(prompt, **seeded), timeout=60)
    others = [token_request([30 + i] * (3 + i), max_tokens=20, temperature=0.9, seed=i,
                            ignore_eos=True) for i in range(15)]
    for index, request in enumerate(others):
        request.request_id = f"seeded-other-{index}"
    batched = token_request(prompt, **seeded)
    batched.request_id = "seeded-batched"
    with ThreadPoolExecutor(16) as pool:
        with llama_server.workers_paused():  # all 16 queued together: they share their steps
            futures = [pool.submit(llama_server.stub.Generate, req, timeout=60) for req in [*others, batched]]
            llama_server.wait_submitted(*(request.request_id for request in [*others, batched]))
        together = futures[-1].result()
        for future in futures:
            future.result()
    assert list(alone.completions[0].token_ids) == list(together.completions[0].token_ids)
    unseeded_differs = llama_server.stub.Generate(
        token_request(prompt, max_tokens=20, temperature=1.0, seed=99, ignore_eos=True), timeout=60)
    assert list(unseeded_differs.completions[0].token_ids) != list(alone.completions[0].token_ids)


def test_block_pool_whole_after_requests(llama_server):
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: llama_server.stub.Generate(
            token_request([40 + i] * (10 + 17 * i), max_tokens=10 + i), timeout=60), range(8)))
    stats = llama_server.wait_idle()
    assert stats.is_pool_consistent
    assert stats.num_gpu_blocks_used == 0
    assert stats.num_gpu_blocks_free + stats.num_gpu_blocks_cached == stats.num_gpu_blocks_total
    assert stats.num_gpu_blocks_total == 256
