"""Riding out the loss of the scheduler: how one request waits for a scheduler that can take it again.

A scheduler that dies takes the request with it, but the frontend holds what is needed to go on:
per index, the token ids the client has and whether that completion ended (updates.py). When the
stream breaks (SchedulerLost) the request is resubmitted as a continuation, so the client's stream
goes on without a gap or a repeated token:

```
 stream breaks ──► same scheduler instance answers GetInfo? ── yes: it ended the stream itself:
 (UNAVAILABLE,           │ no (unreachable, or restarted)        fail with its UNAVAILABLE
  CANCELLED by peer)     ▼
                  wait for a ready scheduler of another instance (--scheduler-recovery-timeout)
                         │ none in time: UNAVAILABLE            │ ready
                         ▼                                      ▼
                  resubmit: prompt + Continuation per index (generated token ids, finished?)
                  beam search: the bare request again (nothing was streamed yet)
```

Every frontend resubmits at once, so the new scheduler's queue may be full: a continuation it
refuses (RESOURCE_EXHAUSTED) is tried again every BUSY_RETRY_S, for up to the recovery timeout
from the first refusal. Logprobs of tokens already streamed are not recomputed; usage keeps the
original prompt's count.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import grpc
import structlog

from pagedserve.frontend.upstream.readiness import ReadinessMonitor
from pagedserve.frontend.upstream.scheduler_client import (
    SchedulerBusy, SchedulerInfo, SchedulerLost, SchedulerUnavailable, SubmitCancelled,
)

log = structlog.get_logger()
BUSY_RETRY_S = 0.5  # a resubmission the new scheduler's full queue refused is tried again after this


@dataclass(frozen=True, slots=True)
class SchedulerRecovery:
    """How a request rides out the loss of its scheduler: `readiness` tells a restarted scheduler
    from the one that ran the request; `timeout_s` bounds each wait (0: no recovery)."""

    readiness: ReadinessMonitor
    timeout_s: float


class Recovery:
    """One request's recovery (`settings` None or a zero timeout: none, the loss fails it)."""

    def __init__(self, settings: SchedulerRecovery | None, cancelled: threading.Event) -> None:
        self.settings = settings
        self._cancelled = cancelled
        self._busy_since: float | None = None  # a resubmission refused for a full queue since then

    @property
    def is_on(self) -> bool:
        return self.settings is not None and self.settings.timeout_s > 0

    def watch(self, readiness: ReadinessMonitor) -> None:
        """The request moved to another replica: its scheduler is told apart through this monitor."""
        if self.settings is not None:
            self.settings = replace(self.settings, readiness=readiness)

    def on_output(self) -> None:
        """A scheduler took the request and answered: a later refusal starts a new wait."""
        self._busy_since = None

    def await_new_scheduler(self, lost: SchedulerLost, broke_at: float, instance_id: str,
                            time_left: float | None, **progress) -> SchedulerInfo:
        """The scheduler of another instance, once it is ready to take the continuation; raises when
        the stream ended for good (the scheduler that ran it is alive, no recovery, time's up).
        progress: what the request had done, for the log lines."""
        settings = self.settings
        if not self.is_on or self._cancelled.is_set():
            raise lost
        answer = settings.readiness.answer_after(broke_at)
        if answer is not None and answer.instance_id == instance_id:
            raise lost  # the scheduler that ran it is up: it ended the stream itself
        log.warning("scheduler_lost", error=str(lost), recovery_timeout=settings.timeout_s, **progress)
        timeout = settings.timeout_s
        info = settings.readiness.wait_for_new_scheduler(
            instance_id, timeout if time_left is None else min(timeout, time_left), self._cancelled.is_set)
        if self._cancelled.is_set():
            raise SubmitCancelled("cancelled while waiting for the scheduler to come back", grpc.StatusCode.CANCELLED)
        if info is None:
            raise SchedulerUnavailable(f"the scheduler was lost and none was ready again within "
                                       f"{timeout:g}s (--scheduler-recovery-timeout); {lost}")
        return info

    def await_queue_room(self) -> None:
        """Returns when a continuation the new scheduler's full queue refused may be tried again;
        raises SchedulerBusy once the refusals have lasted the recovery timeout."""
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
        if now - self._busy_since + BUSY_RETRY_S > self.settings.timeout_s:
            raise SchedulerBusy("the restarted scheduler's queue stayed full: the request could not be resumed",
                                grpc.StatusCode.RESOURCE_EXHAUSTED)
        if self._cancelled.wait(BUSY_RETRY_S):
            raise SubmitCancelled("cancelled while waiting for room in the scheduler's queue",
                                  grpc.StatusCode.CANCELLED)
