"""Scheduler readiness, polled in the background and published through grpc.health.v1.

Health service `""` is SERVING while the process is up; `pagedserve.v1.Generation` is SERVING only
while the scheduler answers GetInfo with is_ready (every worker registered and loaded), and
NOT_SERVING otherwise. The scheduler is asked every poll interval (1 s) while it is ready and every
RECOVERY_POLL_INTERVAL_S while it is not (workers loading, a restart), so that the frontend turns
SERVING within a fraction of a second of the scheduler. The latest SchedulerInfo also gives the
model limits requests are validated against.

It also serves the requests whose Submit stream broke (generation/recovery.py): `answer_after()` asks
whether the scheduler that ran them is still there (same instance_id: it ended them itself), and
`wait_for_new_scheduler()` waits until another instance is ready, polling every
RECOVERY_POLL_INTERVAL_S while anyone waits. One GetInfo at a time serves every caller, however
many requests broke at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import structlog
from grpc_health.v1 import health, health_pb2

from pagedserve.frontend.upstream.scheduler_client import SchedulerClient, SchedulerError, SchedulerInfo, SchedulerUnavailable

GENERATION_SERVICE = "pagedserve.v1.Generation"
DEFAULT_POLL_INTERVAL_S = 1.0
RECOVERY_POLL_INTERVAL_S = 0.2  # while the scheduler is not ready, or a request waits for a restarted one
GET_INFO_TIMEOUT_S = 2.0

log = structlog.get_logger()


class ReadinessMonitor:
    """Keeps `health` in step with the scheduler's readiness; `require_ready()` for request paths."""

    def __init__(self, client: SchedulerClient, health_servicer: health.HealthServicer,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S) -> None:
        self._client = client
        self._health = health_servicer
        self._poll_interval_s = poll_interval_s
        self._info: SchedulerInfo | None = None
        self._last_error = "the scheduler has not been asked yet"
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # notified after every GetInfo
        self._asking = threading.Lock()  # one GetInfo at a time
        self._last_asked_at = float("-inf")  # when the latest GetInfo was sent (monotonic)
        self._last_answer: SchedulerInfo | None = None  # its answer; None: unreachable
        self._num_waiting = 0  # requests waiting for a new scheduler
        self._wake = threading.Event()  # polls now (a waiter arrived, or stop)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._is_shutting_down = False
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def info(self) -> SchedulerInfo | None:
        """The latest answer of the scheduler (None until it has answered once)."""
        with self._lock:
            return self._info

    @property
    def is_ready(self) -> bool:
        info = self.info
        return info is not None and info.is_ready

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._poll, name="readiness-monitor", daemon=True)
        self._thread.start()

    def begin_drain(self) -> None:
        """Marks the Generation service NOT_SERVING for good; the process stays alive ("" SERVING)."""
        with self._lock:
            self._is_shutting_down = True
            self._health.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("readiness_draining")

    def stop(self) -> None:
        """Stops polling and marks every service NOT_SERVING (graceful shutdown)."""
        with self._lock:
            self._is_shutting_down = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self._poll_interval_s + GET_INFO_TIMEOUT_S + 1.0)
        self._health.enter_graceful_shutdown()

    @property
    def last_error(self) -> str:
        """Why the last answer was not ready ("" when it was)."""
        with self._lock:
            return self._last_error

    def refresh(self) -> SchedulerInfo | None:
        """Asks the scheduler now and updates the health status; returns the answer or None."""
        with self._asking:
            return self._ask()

    def answer_after(self, moment: float) -> SchedulerInfo | None:
        """The scheduler's answer to a GetInfo sent at or after `moment` (time.monotonic()), or None
        when it was unreachable; shares a GetInfo with the callers that queued behind it."""
        with self._asking:
            if self._last_asked_at >= moment:
                return self._last_answer
            return self._ask()

    def wait_for_new_scheduler(self, gone_instance_id: str, timeout: float,
                               is_cancelled: Callable[[], bool]) -> SchedulerInfo | None:
        """Waits up to `timeout` seconds for a ready scheduler other than instance
        `gone_instance_id` (a restarted one); None when none came, or when is_cancelled()."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._num_waiting += 1
        self._wake.set()
        try:
            with self._lock:
                while True:
                    info = self._info
                    if info is not None and info.is_ready and info.instance_id != gone_instance_id:
                        return info
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or is_cancelled() or self._stop.is_set():
                        return None
                    self._answered.wait(min(remaining, RECOVERY_POLL_INTERVAL_S))
        finally:
            with self._lock:
                self._num_waiting -= 1

    def _ask(self) -> SchedulerInfo | None:
        asked_at = time.monotonic()
        try:
            info = self._client.get_info(timeout=GET_INFO_TIMEOUT_S)
            error = "" if info.is_ready else "the scheduler is not ready (workers loading or lost, or it is draining)"
        except SchedulerError as exc:
            info, error = None, f"the scheduler at {self._client.address} is unreachable: {exc}"
        self._last_asked_at, self._last_answer = asked_at, info
        with self._lock:
            was_ready = self._info is not None and self._info.is_ready
            if info is not None:
                self._info = info
            elif self._info is not None:
                self._info = replace(self._info, is_ready=False)  # last known limits, not ready
            is_ready = self._info is not None and self._info.is_ready
            self._last_error = error
            self._answered.notify_all()
        if is_ready != was_ready:
            log.info("scheduler_readiness_changed", is_ready=is_ready, reason=error or "ready")
        with self._lock:
            if not self._is_shutting_down:
                status = health_pb2.HealthCheckResponse.SERVING if is_ready else health_pb2.HealthCheckResponse.NOT_SERVING
                self._health.set(GENERATION_SERVICE, status)
        return info

    def require_ready(self) -> SchedulerInfo:
        """The scheduler's info when it is ready (asking again if the last answer said otherwise);
        raises SchedulerUnavailable when it is not."""
        info = self.info
        if info is not None and info.is_ready:
            return info
        info = self.refresh()
        if info is not None and info.is_ready:
            return info
        with self._lock:
            raise SchedulerUnavailable(self._last_error)

    def _poll(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                is_ready = self._info is not None and self._info.is_ready
                interval = self._poll_interval_s
                if self._num_waiting or not is_ready:
                    interval = min(interval, RECOVERY_POLL_INTERVAL_S)
            self._wake.wait(interval)
            self._wake.clear()
            if not self._stop.is_set():
                self.refresh()
