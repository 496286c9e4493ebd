"""Collects the scheduler's per-step records (tokens, step and forward seconds) while a run of
benchmark requests goes on against a `pagedserve.launch.serve_process.ServeProcess`."""

from __future__ import annotations

import threading

import grpc

from pagedserve.security.bearer_auth import with_bearer
from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.launch.serve_process import ServeProcess


class StepRecorder:
    """Polls the scheduler's recent step records (the last 256 steps) while the block runs;
    `records` holds every step of the block seen, by step id.

    interval=None: no polling, the records are read by `collect()` (between requests sent one
    after another) and at the block's end. A GetStats read runs on the scheduler's step loop
    between steps, after the end of a decode run in flight (scheduler/engine.py Engine.call)."""

    def __init__(self, server: ServeProcess, interval: float | None = 0.5) -> None:
        self._channel = grpc.insecure_channel(f"127.0.0.1:{server.scheduler_port}")
        self._stub = scheduler_pb2_grpc.SchedulerStub(with_bearer(self._channel, server.internal_token))
        self._interval = interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="step-recorder", daemon=True)
        self.records: dict[int, scheduler_pb2.StepSummary] = {}
        self._earlier: set[int] = set()

    def collect(self) -> None:
        """Reads the recent step records now."""
        request = scheduler_pb2.GetStatsRequest(max_recent_steps=256)
        for record in self._stub.GetStats(request, timeout=10).recent_steps:
            self.records[record.step_id] = record

    def _poll(self) -> None:
        while not self._done.wait(self._interval):
            self.collect()

    def __enter__(self) -> "StepRecorder":
        self.collect()
        self._earlier = set(self.records)  # steps before the block (an earlier run's) are left out
        self.records.clear()
        if self._interval is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        self.collect()
        self._channel.close()
        for step_id in self._earlier:
            self.records.pop(step_id, None)
