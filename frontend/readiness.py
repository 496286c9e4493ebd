"""Scheduler readiness, polled in the background and published through grpc.health.v1.

Health service `""` is SERVING while the process is up; `pagedserve.v1.Generation` is SERVING only
while the scheduler answers GetInfo with is_ready (every worker registered and loaded), and
NOT_SERVING otherwise. The latest SchedulerInfo also gives the model limits requests are validated
against.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import structlog
from grpc_health.v1 import health, health_pb2

from pagedserve.frontend.scheduler_client import SchedulerClient, SchedulerError, SchedulerInfo, SchedulerUnavailable

GENERATION_SERVICE = "pagedserve.v1.Generation"
DEFAULT_POLL_INTERVAL_S = 1.0
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
        if self._thread is not None:
            self._thread.join(timeout=self._poll_interval_s + GET_INFO_TIMEOUT_S + 1.0)
        self._health.enter_graceful_shutdown()

    def refresh(self) -> SchedulerInfo | None:
        """Asks the scheduler now and updates the health status; returns the answer or None."""
        try:
            info = self._client.get_info(timeout=GET_INFO_TIMEOUT_S)
            error = "" if info.is_ready else "the scheduler is not ready (workers loading or lost, or it is draining)"
        except SchedulerError as exc:
            info, error = None, f"the scheduler at {self._client.address} is unreachable: {exc}"
        with self._lock:
            was_ready = self._info is not None and self._info.is_ready
            if info is not None:
                self._info = info
            elif self._info is not None:
                self._info = replace(self._info, is_ready=False)  # last known limits, not ready
            is_ready = self._info is not None and self._info.is_ready
            self._last_error = error
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
        while not self._stop.wait(self._poll_interval_s):
            self.refresh()
