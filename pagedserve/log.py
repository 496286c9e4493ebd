"""Structured JSON logs (structlog) shared by every process; one line per event on stderr."""

from __future__ import annotations

import logging
import os
import sys

import structlog

LOG_LEVEL_ENV = "PAGEDSERVE_LOG_LEVEL"


def configure_logging(process: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    """Configures structlog for JSON output and returns a logger bound to the process name."""
    level_name = (level or os.environ.get(LOG_LEVEL_ENV, "INFO")).upper()
    numeric_level = getattr(logging, level_name, logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_process(process),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),  # one write per line
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(process=process, pid=os.getpid())


def _add_process(process: str):
    """Names the process on every event, whichever logger or thread logs it."""
    pid = os.getpid()

    def add(_logger, _method, event_dict: dict) -> dict:
        event_dict.setdefault("process", process)
        event_dict.setdefault("pid", pid)
        return event_dict

    return add


def get_logger(**bindings) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger().bind(**bindings)
