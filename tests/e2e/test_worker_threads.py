"""A worker on a shared CPU loads its model on one thread and serves at its full thread count as
soon as it is ready (worker/cpu_share.py): the first request after a start is not left to one
thread until a calm check."""

from __future__ import annotations

from tests.e2e.harness import ServeProcess, wait_for


def _ready_threads(server: ServeProcess) -> list[int]:
    return [event["num_threads"] for event in server.log_events() if event["event"] == "kv_cache_ready"]


def test_the_worker_has_every_thread_when_serve_is_ready(llama_checkpoint, tmp_path) -> None:
    # empty wait variables count as unset: the worker adapts its threads (cpu_share.choose_openmp_waits)
    env = {"GOMP_SPINCOUNT": "", "OMP_WAIT_POLICY": ""}
    with ServeProcess(llama_checkpoint, tmp_path / "serve.log", env=env, num_threads=2) as server:
        assert wait_for(lambda: _ready_threads(server), timeout=30.0), server.logs()[-3000:]
        assert _ready_threads(server) == [2], server.logs()[-3000:]


def test_an_operator_choice_of_waits_keeps_the_thread_count(llama_checkpoint, tmp_path) -> None:
    env = {"OMP_WAIT_POLICY": "PASSIVE"}  # fixed threads: all of them from the start
    with ServeProcess(llama_checkpoint, tmp_path / "serve.log", env=env, num_threads=2) as server:
        assert wait_for(lambda: _ready_threads(server), timeout=30.0), server.logs()[-3000:]
        assert _ready_threads(server) == [2], server.logs()[-3000:]
