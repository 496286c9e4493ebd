"""--scheduling-policy priority on a real `serve`: under a flood of priority-10 streams that
keeps every running slot taken (--max-num-seqs 2) and the waiting queue full, a priority-0
request preempts one of them, runs before every waiting one, and gets its first token in as many
scheduler steps as when the server is idle (its prefill, chunked by the step's token budget);
without the policy it would wait for a slot, which no flood stream frees (none can finish).

Time to first token is counted in steps, not seconds, and the flood is set up behind paused
workers (ServeProcess.workers_paused), so the outcome does not depend on the host's speed or load."""

from __future__ import annotations

import threading

import grpc
import pytest

from tests.e2e.conftest import start_server
from tests.e2e.harness import PAUSE_ARGS, assert_pool_whole, token_request, wait_for

NUM_FLOOD_STREAMS = 8
MAX_NUM_SEQS = 2
FLOOD_MAX_TOKENS = 1000  # no flood stream finishes while the test runs: it cancels them
PROMPT_LEN = 768  # two chunks of the 512-token step budget


@pytest.fixture(scope="module")
def priority_server(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "priority", "--scheduling-policy", "priority",
                          "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", "256",
                          "--max-num-batched-tokens", "512", *PAUSE_ARGS)
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


def _urgent(server, request_id: str, first_token: int) -> list[int]:
    """A priority-0 request of one token (every step it is in is a prefill chunk); its step ids."""
    request = token_request([first_token] + [7] * (PROMPT_LEN - 1), max_tokens=1, ignore_eos=True)
    request.request_id = request_id
    request.priority = 0
    response = server.stub.Generate(request, timeout=120)
    assert len(response.completions[0].token_ids) == 1
    return _steps_with(server, request_id)


def _steps_with(server, request_id: str) -> list[int]:
    return [step.step_id for step in server.stats(max_recent_steps=256).recent_steps
            if request_id in step.request_ids]


def test_priority_zero_keeps_its_ttft_under_a_flood_of_priority_ten(priority_server):
    server = priority_server
    idle_steps = _urgent(server, "urgent-idle", 3)

    flood_ids = [f"flood-{index}" for index in range(NUM_FLOOD_STREAMS)]
    calls, errors = [], []

    def read(call) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                errors.append(exc)

    with server.workers_paused():  # the whole flood waits before its first step
        for index, request_id in enumerate(flood_ids):
            request = token_request([100 + index, 101, 102, 103], max_tokens=FLOOD_MAX_TOKENS, ignore_eos=True)
            request.request_id = request_id
            request.priority = 10
            calls.append(server.stub.GenerateStream(request, timeout=300))
        server.wait_submitted(*flood_ids)
    readers = [threading.Thread(target=read, args=(call,), daemon=True) for call in calls]
    for reader in readers:
        reader.start()
    try:
        assert wait_for(lambda: (lambda stats: (stats.num_running, stats.num_waiting))(server.stats())
                        == (MAX_NUM_SEQS, NUM_FLOOD_STREAMS - MAX_NUM_SEQS), timeout=60), \
            "the flood did not saturate the scheduler"
        before = server.stats(max_recent_steps=1)
        with server.workers_paused():  # it arrives while two flood streams run and six wait
            loaded: list[int] = []
            urgent = threading.Thread(target=lambda: loaded.extend(_urgent(server, "urgent-loaded", 4)))
            urgent.start()
            server.wait_submitted("urgent-loaded")
        urgent.join(120)
        stats = server.stats(max_recent_steps=256)
        assert stats.num_waiting >= 1  # still saturated after it
        assert (stats.num_preemptions_recompute + stats.num_preemptions_swap
                > before.num_preemptions_recompute + before.num_preemptions_swap)
    finally:
        for call in calls:
            call.cancel()
        for reader in readers:
            reader.join(timeout=60)
    assert not errors, errors
    steps = {step.step_id: set(step.request_ids) for step in stats.recent_steps}
    first = loaded[0]
    running_before = steps[first - 1] & set(flood_ids)
    assert len(running_before) == MAX_NUM_SEQS, "the flood did not hold every running slot"
    assert steps[first] & set(flood_ids) < running_before, "a running flood stream was not preempted for it"
    for step_id in range(first, loaded[-1] + 1):  # no waiting flood stream ran before its first token
        assert steps[step_id] & set(flood_ids) <= running_before, (step_id, steps[step_id])
    print(f"priority 0 time to first token: idle {len(idle_steps)} steps, under the flood {len(loaded)} steps")
    assert loaded == list(range(first, first + len(loaded)))  # in every step from its first one
    assert len(loaded) <= len(idle_steps), (idle_steps, loaded)
    assert_pool_whole(server)
