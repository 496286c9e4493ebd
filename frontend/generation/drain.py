"""The frontend's requests in flight, and the drain that ends them before the process exits.

    serving ──SIGTERM──▶ draining: readiness NOT_SERVING, new requests UNAVAILABLE,
                         running ones go on ──all done, or shutdown timeout──▶ cut the rest ──▶ exit
                                                                              (UNAVAILABLE: retry)

Generate calls register in `enter()` and leave in `leave()`; `drain()` waits for the count to
reach zero, `cut()` cancels what is left (which aborts those requests in the scheduler).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Draining(RuntimeError):
    """The frontend is shutting down and takes no new requests."""


class RequestCut(RuntimeError):
    """The drain's time ran out and `cut()` ended this request (the client should retry elsewhere)."""

    def __init__(self) -> None:
        super().__init__("the frontend shut down before the request finished; retry on another instance")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class InFlight:
    """Thread-safe set of running requests; refuses new ones once draining."""

    def __init__(self) -> None:
        self._running: set[Cancellable] = set()
        self._cut: set[int] = set()
        self._is_draining = False
        self._changed = threading.Condition()

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    def __len__(self) -> int:
        with self._changed:
            return len(self._running)

    def enter(self, request: Cancellable) -> None:
        with self._changed:
            if self._is_draining:
                raise Draining("the frontend is shutting down; retry on another instance")
            self._running.add(request)

    def leave(self, request: Cancellable) -> None:
        with self._changed:
            self._running.discard(request)
            self._cut.discard(id(request))
            self._changed.notify_all()

    def was_cut(self, request: Cancellable) -> bool:
        """Whether `cut()` ended this request (it then fails with UNAVAILABLE, not CANCELLED)."""
        with self._changed:
            return id(request) in self._cut

    def drain(self, timeout: float) -> int:
        """Refuses new requests and waits up to `timeout` seconds; returns how many still run."""
        deadline = time.monotonic() + timeout
        with self._changed:
            self._is_draining = True
            while self._running and (remaining := deadline - time.monotonic()) > 0:
                self._changed.wait(remaining)
            return len(self._running)

    def cut(self, timeout: float) -> int:
        """Cancels every request still running and waits up to `timeout` for their handlers."""
        with self._changed:
            running = list(self._running)
            self._cut.update(id(request) for request in running)
        for request in running:
            request.cancel()
        return self.drain(timeout)
