"""Exceptions raised by the scheduler core.

Callers map them to transport errors: `RequestRejected` is the client's fault (INVALID_ARGUMENT),
`StepOrderError` and `InvariantError` are programming errors in the caller or in the scheduler.
"""

from __future__ import annotations

from pagedserve.config_flags import ConfigError


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


class NoFreeBlocks(SchedulerError, RuntimeError):
    """A block pool had neither a free nor an evictable block; the scheduler checks first."""


class StepOrderError(SchedulerError, RuntimeError):
    """schedule() and process_result() were called out of order, or a result does not fit its step."""


class InvariantError(SchedulerError, AssertionError):
    """check_invariants() found inconsistent block accounting or queue state."""
