"""Exceptions raised by the scheduler core.

Callers map them to transport errors: `RequestRejected` is the client's fault (INVALID_ARGUMENT),
`StepOrderError` and `InvariantError` are programming errors in the caller or in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config.flags import ConfigError


class SchedulerError(Exception):
    """Base class of every exception the scheduler raises on purpose."""


class SchedulerConfigError(SchedulerError, ConfigError):
    """A SchedulerConfig field is out of range; `field_name` names it."""


class RequestRejected(SchedulerError, ValueError):
    """add_request refused a request that could never be served; `reason` says why."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason}")
        self.request_id = request_id
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """A request dropped because its step could not be handled; only it fails."""

    request_id: str
    message: str


class RequestFailed(SchedulerError, RuntimeError):
    """Given to a failed request's caller (INTERNAL): its sampling or output handling raised, or
    it was in flight whenever the workers crashed, too often to be replayed."""


class NoFreeBlocks(SchedulerError, RuntimeError):
    """A block pool had neither a free nor an evictable block; the scheduler checks first."""


class StepOrderError(SchedulerError, RuntimeError):
    """schedule() and process_result() were called out of order, or a result does not fit its step."""


class InvariantError(SchedulerError, AssertionError):
    """check_invariants() found inconsistent block accounting or queue state."""
