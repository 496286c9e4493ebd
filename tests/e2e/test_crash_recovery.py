"""Crashes under `serve`: a worker killed mid-stream is restarted and the streams complete unchanged;
an idle worker killed again and again costs one restart each time, with back-off; a killed
scheduler is restarted and the workers serve it without a restart of their own."""

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
        # the streams cannot end between the check and the kill (a pause of a moment: no
        # heartbeat is missed)
        with server.workers_paused():
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


def _num_events(server, event: str, process: str) -> int:
    return sum(1 for e in server.log_events() if e.get("event") == event and e.get("process") == process)


def _wait_recovered(server, num_workers_ready: int) -> None:
    """Waits for the scheduler's num_workers_ready-th `workers_ready` (health alone can be stale:
    the frontend polls the scheduler once a second), then for health SERVING."""
    assert wait_for(lambda: _num_events(server, "workers_ready", "scheduler") >= num_workers_ready,
                    timeout=120), server.logs()[-3000:]
    assert wait_for(lambda: server.health() == health_pb2.HealthCheckResponse.SERVING, timeout=30)


def _greedy(server, prompt: list[int]) -> list[int]:
    return list(server.stub.Generate(token_request(prompt, max_tokens=24, ignore_eos=True),
                                     timeout=120).completions[0].token_ids)


def test_an_idle_worker_killed_three_times_costs_one_restart_each(llama_checkpoint, tmp_path_factory):
    """With the default restart policy, three kills of an idle worker in a row: each is one restart
    (the scheduler keeps the new rank instead of telling it to exit), after a back-off, and each
    time the replica serves the undisturbed tokens again. The budget's end is
    tests/test_restart_policy.py's and tests/test_supervisor_restarts.py's."""
    server = start_server(llama_checkpoint, tmp_path_factory, "idle-kills", "--num-kv-blocks", "128")
    try:
        undisturbed = _greedy(server, PROMPTS[1])
        for kill in range(3):
            old_worker = server.child_pids()["worker-0"]
            os.kill(old_worker, signal.SIGKILL)
            assert wait_for(lambda: server.child_pids().get("worker-0") not in (None, old_worker), timeout=60)
            new_worker = server.child_pids()["worker-0"]
            _wait_recovered(server, num_workers_ready=kill + 2)
            assert _greedy(server, PROMPTS[1]) == undisturbed
            assert server.child_pids()["worker-0"] == new_worker, "a second restart for one crash"
        events = server.log_events()
        started = [e for e in events if e.get("event") == "child_started" and e.get("child") == "worker-0"]
        exited = [e for e in events if e.get("event") == "child_exited" and e.get("child") == "worker-0"]
        assert len(started) == 4 and len(exited) == 3, server.logs()[-4000:]
        assert [e["restarts_left"] for e in exited] == [4, 3, 2]
        assert [e["delay_seconds"] for e in exited] == [1, 2, 4]
        assert not any(e.get("event") == "shutdown" and e.get("process") == "worker" for e in events)
    finally:
        code = server.stop()
    assert code == 0, server.logs()[-3000:]


def test_a_killed_scheduler_is_restarted_and_the_workers_outlive_it(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "scheduler-kill", "--num-kv-blocks", "128")
    try:
        undisturbed = _greedy(server, PROMPTS[2])
        pids = server.child_pids()
        os.kill(pids["scheduler"], signal.SIGKILL)
        assert wait_for(lambda: server.child_pids().get("scheduler") not in (None, pids["scheduler"]), timeout=60)
        _wait_recovered(server, num_workers_ready=2)
        assert _greedy(server, PROMPTS[2]) == undisturbed
        after = server.child_pids()
        assert (after["worker-0"], after["frontend"]) == (pids["worker-0"], pids["frontend"])
        assert server.stats().is_pool_consistent
    finally:
        code = server.stop()
    assert code == 0, server.logs()[-3000:]
