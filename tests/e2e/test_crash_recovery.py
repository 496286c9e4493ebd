"""A worker killed mid-stream under `serve` is restarted and the streams complete unchanged."""

from __future__ import annotations

import os
import signal
import threading
import time

from grpc_health.v1 import health_pb2

from tests.e2e.conftest import start_server
from tests.e2e.harness import stream_tokens, token_request, wait_for

PROMPTS = [[7 + i, 40, 41, 42 + 3 * i] * (2 + i) for i in range(4)]
MAX_TOKENS = 300


def test_killed_worker_is_restarted_and_streams_complete(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "recovery", "--num-kv-blocks", "128",
                          "--max-num-seqs", "4")
    try:
        undisturbed = [list(server.stub.Generate(
            token_request(p, max_tokens=MAX_TOKENS, ignore_eos=True), timeout=120)
            .completions[0].token_ids) for p in PROMPTS]
        old_worker = server.child_pids()["worker-0"]
        received: list[list[int]] = [[] for _ in PROMPTS]
        errors: list[Exception] = []
        threads = [threading.Thread(target=stream_tokens, args=(server, p, r, errors),
                                kwargs={"max_tokens": MAX_TOKENS})
                   for p, r in zip(PROMPTS, received)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: all(len(r) >= 5 for r in received), timeout=60)
        os.kill(old_worker, signal.SIGKILL)
        killed_at = time.monotonic()
        at_kill = [len(r) for r in received]
        assert min(at_kill) < MAX_TOKENS, "the streams finished before the kill"

        assert wait_for(lambda: server.health() == health_pb2.HealthCheckResponse.NOT_SERVING
                        or server.child_pids().get("worker-0") not in (None, old_worker),
                        timeout=30)
        for thread in threads:
            thread.join(240)
        assert not errors, errors
        assert received == undisturbed
        new_worker = server.child_pids()["worker-0"]
        assert new_worker != old_worker
        # Readiness follows the scheduler's GetInfo, polled once a second: the streams can end
        # before the first poll that sees the restarted worker.
        assert wait_for(lambda: server.health() == health_pb2.HealthCheckResponse.SERVING, timeout=10)
        stats = server.wait_idle()
        assert stats.is_pool_consistent and stats.num_gpu_blocks_used == 0
        events = server.log_events()
        assert any(e.get("event") == "requests_resumed" for e in events)
        assert time.monotonic() - killed_at < 200
    finally:
        code = server.stop()
    assert code == 0, server.logs()[-3000:]
