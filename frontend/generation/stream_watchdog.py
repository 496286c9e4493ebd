"""Slow readers: a stream whose client stops reading is cut after --stream-write-timeout.

A server-streaming handler hands each message to gRPC and is blocked until the transport has
taken it; a client that stops reading fills the HTTP/2 window and the handler waits forever,
holding its call slot, its thread and its request's KV blocks. Each stream marks the time it
starts a write; one thread looks at the streams every tick and, for a write pending longer than
the timeout, calls its `on_timeout` once (which aborts the request in the scheduler and cancels
the call, so the blocked write returns):

    handler   ──write(begin)──────── blocked ─────────────────┐ cancelled: the write returns
    watchdog        tick   tick   tick  … pending > timeout ──┘ on_timeout()

The undelivered output of a request is bounded too: while a write is pending nothing more is read
from the scheduler (the handler pulls the next output only after the write), so at most one
message waits in the frontend, and the timeout bounds how long the scheduler holds the rest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Iterator
from contextlib import contextmanager

import structlog

log = structlog.get_logger()
DEFAULT_STREAM_WRITE_TIMEOUT_S = 60.0
MAX_TICK_S = 1.0


class StreamWatch:
    """One stream's pending write (None when none) and what to do when it lasts too long."""

    def __init__(self, on_timeout: Callable[[], None]) -> None:
        self.on_timeout = on_timeout
        self.write_started: float | None = None
        self.has_timed_out = False

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around the `yield` of a message to gRPC."""
        self.write_started = time.monotonic()
        try:
            yield
        finally:
            self.write_started = None


class StreamWatchdog:
    """Calls a stream's on_timeout when one of its writes has been pending for `timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the stream write timeout must be > 0, not {timeout_s}")
        self.timeout_s = timeout_s
        self._watches: set[StreamWatch] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watch(self, on_timeout: Callable[[], None]) -> Iterator[StreamWatch]:
        stream = StreamWatch(on_timeout)
        with self._lock:
            self._watches.add(stream)
        try:
            yield stream
        finally:
            with self._lock:
                self._watches.discard(stream)

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        tick = min(MAX_TICK_S, self.timeout_s / 4)
        while not self._stopped.wait(tick):
            now = time.monotonic()
            with self._lock:
                late = [w for w in self._watches if not w.has_timed_out and w.write_started is not None
                        and now - w.write_started > self.timeout_s]
            for stream in late:
                stream.has_timed_out = True
                try:
                    stream.on_timeout()
                except Exception as exc:  # one stream's failure must not stop the watchdog
                    log.error("stream_write_timeout_failed", error=str(exc), exc_info=exc)
