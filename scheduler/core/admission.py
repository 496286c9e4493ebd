"""Back-pressure: the bounded queue of requests that were accepted but not yet scheduled.

    submit ──admit()──▶ queued (counted: requests, prompt tokens) ──first schedule──▶ running
      │ over a bound: QueueFull (RESOURCE_EXHAUSTED, nothing was started; safe to retry elsewhere)
      └ released early by an abort, a rejection or lost workers

A request is counted from `admit()` (a gRPC thread) until `release()` (the step loop) at its first
schedule, abort or rejection. Groups preempted later go back to the scheduler's waiting queue but
are not counted again: they are admitted work. A request is always admitted into an empty queue,
so one prompt longer than the token bound is not refused forever.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the request was not accepted."""


class DuplicateRequest(ValueError):
    """A request with this id is already waiting."""


@dataclass(slots=True)
class _Queued:
    num_tokens: int
    arrival: float  # time.monotonic() at admission


class Admission:
    """Thread-safe counts of queued requests and their prompt tokens, with both bounds."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        if max_requests <= 0 or max_tokens <= 0:
            raise ValueError("the waiting queue bounds must be positive")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._queued: dict[str, _Queued] = {}
        self._num_tokens = 0
        self._lock = threading.Lock()

    @property
    def num_queued(self) -> int:
        with self._lock:
            return len(self._queued)

    @property
    def num_queued_tokens(self) -> int:
        with self._lock:
            return self._num_tokens

    def admit(self, request_id: str, num_tokens: int) -> None:
        """Counts the request in, or raises QueueFull / DuplicateRequest."""
        with self._lock:
            if request_id in self._queued:
                raise DuplicateRequest(f"request_id: a request with id {request_id!r} is already waiting")
            if len(self._queued) >= self.max_requests:
                raise QueueFull(f"the waiting queue is full ({self.max_requests} requests); "
                                "retry later or on another replica")
            if self._queued and self._num_tokens + num_tokens > self.max_tokens:
                raise QueueFull(f"the waiting queue is full ({self._num_tokens} prompt tokens waiting, "
                                f"bound {self.max_tokens}); retry later or on another replica")
            self._queued[request_id] = _Queued(num_tokens, time.monotonic())
            self._num_tokens += num_tokens

    def release(self, request_id: str, now: float | None = None) -> float | None:
        """Counts the request out; returns how long it was queued, or None if it was not."""
        with self._lock:
            entry = self._queued.pop(request_id, None)
            if entry is None:
                return None
            self._num_tokens -= entry.num_tokens
        return (time.monotonic() if now is None else now) - entry.arrival

    def clear(self) -> None:
        with self._lock:
            self._queued.clear()
            self._num_tokens = 0
