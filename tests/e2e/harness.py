"""Starts `pagedserve serve` as a user would (a real process tree) and talks to it over gRPC."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

from pagedserve.internal import scheduler_pb2
from pagedserve.launch.serve_process import READY_SERVICE, ServeProcess as _ServeProcess, _children, _role
from pagedserve.v1 import generation_pb2


# serve flags of a tree whose workers a test pauses (ServeProcess.workers_paused): the scheduler
# does not count a paused rank as lost
PAUSE_ARGS = ("--heartbeat-timeout", "600")


class ServeProcess(_ServeProcess):
    """`serve` on the CPU in float32 (the HF-equality oracle's precision; `--dtype auto` would pick
    bfloat16 on CPUs with native bfloat16) with a small swap space (preemption tests swap into it)."""

    def __init__(self, model: str | Path, log_path: Path, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, **options) -> None:
        super().__init__(model, log_path, ["--dtype", "float32", "--swap-space", "0.25", *(extra_args or [])], env, **options)

    def log_events(self) -> list[dict]:
        """The JSON log events of every process of the tree, parsed."""
        return parse_log_events(self.logs())

    def log_events_named(self, name: str) -> int:
        """How many log events of that name the tree has written."""
        return sum(event["event"] == name for event in self.log_events())

    def submitted_ids(self) -> list[str]:
        """Ids of the requests the scheduler has accepted (`request_submitted`), in order."""
        return [event["request_id"] for event in self.log_events()
                if event["event"] == "request_submitted" and event.get("process") == "scheduler"]

    def wait_submitted(self, *request_ids: str, timeout: float = 120.0) -> None:
        """Waits until the scheduler has accepted every one of these requests."""
        if not wait_for(lambda: set(request_ids) <= set(self.submitted_ids()), timeout=timeout):
            raise TimeoutError(f"not submitted: {set(request_ids) - set(self.submitted_ids())}\n"
                               f"{self.logs()[-3000:]}")

    def worker_pids(self) -> list[int]:
        """pids of every worker rank of the tree, those of data-parallel replicas included."""
        found, parents = [], [self.proc.pid]
        while parents:
            children = [child for parent in parents for child in _children(parent)]
            found += [pid for pid in children if (_role(pid) or "").startswith("worker")]
            parents = children
        return found

    @contextlib.contextmanager
    def workers_paused(self):
        """Stops every worker rank (SIGSTOP) for the block and continues them (SIGCONT) after it.

        A gate for preconditions that must not depend on speed: the step in flight cannot finish
        and no further step starts, so requests submitted inside the block all wait in the
        scheduler (in the order the scheduler accepted them, see wait_submitted) and none can
        finish or produce a token until the block ends; after it, the next step sees them all.
        The scheduler's step loop waits for the paused step meanwhile: GetStats (stats, wait_idle)
        does not answer inside the block, the Prometheus gauges do (they show the last step).
        The tree must run with a --heartbeat-timeout longer than the block (PAUSE_ARGS)."""
        pids = self.worker_pids()
        if not pids:
            raise RuntimeError("this serve has no worker processes to pause")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # a rank the test killed meanwhile
                    os.kill(pid, signal.SIGCONT)


class WorkerStop:
    """Stops every worker rank of a tree (SIGSTOP) the first time it is called, from whichever
    thread calls it, and continues them on resume(). A stream's own thread calls it on the token
    that makes a test's precondition true, so the workers stop within one message's delivery of
    that token: a polling thread on a loaded host can wake after a fast host's workers decoded a
    whole request. Like workers_paused, the tree must run with PAUSE_ARGS."""

    def __init__(self, server: ServeProcess) -> None:
        self.pids = server.worker_pids()
        if not self.pids:
            raise RuntimeError("this serve has no worker processes to stop")
        self.stopped = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if not self.stopped.is_set():
                for pid in self.pids:
                    os.kill(pid, signal.SIGSTOP)
                self.stopped.set()

    def resume(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):  # a rank the test killed meanwhile
                os.kill(pid, signal.SIGCONT)


def token_request(prompt_token_ids: list[int], **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.PromptTokenIds(ids=prompt_token_ids),
        params=generation_pb2.SamplingParams(**params))


def text_request(prompt: str, **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt,
                                          params=generation_pb2.SamplingParams(**params))


def stream_tokens(server, prompt: list[int], received: list[int], errors: list[Exception], *,
                  max_tokens: int, timeout: float = 240) -> None:
    """Streams one greedy request (EOS ignored) into received; an error goes to errors (for
    threads, whose test thread reports it)."""
    try:
        for message in server.stub.GenerateStream(
                token_request(prompt, max_tokens=max_tokens, ignore_eos=True), timeout=timeout):
            for completion in message.completions:
                received.extend(completion.token_ids)
    except Exception as exc:
        errors.append(exc)


def parse_log_events(text: str) -> list[dict]:
    """JSON objects of a log several processes wrote to: one per line, except where a process
    left its line unterminated (it exited mid-line) and another's follows on the same line."""
    decoder = json.JSONDecoder()
    events = []
    for line in text.splitlines():
        position = line.find("{")
        while position != -1:
            try:
                event, end = decoder.raw_decode(line, position)
            except json.JSONDecodeError:
                end = position + 1
            else:
                if isinstance(event, dict) and "event" in event:
                    events.append(event)
            position = line.find("{", end)
    return events


def is_running(pid: int) -> bool:
    """False once pid has exited (a zombie awaiting its parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Polls predicate until it is true (True) or timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def assert_pool_whole(server: ServeProcess, timeout: float = 30.0) -> scheduler_pb2.SchedulerStats:
    """Waits until the scheduler is idle, then requires every block back: none used on GPU or
    CPU, free + cached = total, and consistent reference counts."""
    stats = server.wait_idle(timeout)
    assert stats.is_pool_consistent, stats
    assert stats.num_gpu_blocks_used == 0 and stats.num_cpu_blocks_used == 0, stats
    assert stats.num_gpu_blocks_free + stats.num_gpu_blocks_cached == stats.num_gpu_blocks_total, stats
    return stats
