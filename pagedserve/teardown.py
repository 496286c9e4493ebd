"""A server process's exit, once its own shutdown is done: bounded, and without the interpreter's
finalization.

When the scheduler has logged `scheduler_stopped` (or the frontend `frontend_stopped`), everything
the process owns is released: its requests are answered or cut, its workers told, its sockets
closed. What remains is the runtime's teardown: asyncio.run cancelling what is left and joining
its default executor, then the interpreter's exit (atexit hooks, gRPC's and ZeroMQ's threads,
module finalization). That teardown has been seen, rarely, to hang after `scheduler_stopped`;
`serve` then waited its whole drain timeout before killing the process, and so stopped late.

Two steps keep that exit short:

- `bound_teardown()`, called right after the stop is logged, covers asyncio's teardown (tasks
  cancelled, the default executor joined).
- `end_process(code)`, called by `pagedserve serve|scheduler|frontend|worker` once the command has
  returned, flushes stdout and stderr and ends the process with `os._exit`: no atexit hook, no
  module finalization, no C-level exit handler runs. Those stages hold nothing the process still
  owes anyone, and a hang late there is past the watchdog's reach: the interpreter cancels
  faulthandler's watchdog after finalizing its modules (a `__del__` that hangs while they are
  finalized still meets it), before C-level exit handlers and library destructors run. Such a hang
  left `serve` waiting its whole drain timeout (the scheduler's child_killed, 40 s after
  scheduler_stopped, with no stacks in the log). A worker has closed its sockets and flushed its
  KV tier's block files when `run_worker` returns; its finalization (torch's modules) took about
  0.4 s of CPU at every stop, on the path of every restart of a replica.

`bound_teardown()` arms faulthandler's watchdog. Its thread is native and needs no GIL, so it
fires even while the interpreter finalizes. If the process is still alive TEARDOWN_TIMEOUT_S
later, the watchdog writes every Python thread's stack to stderr (which `serve` keeps in its log)
and ends the process with exit code 1. A process that exits in time writes nothing.
"""

from __future__ import annotations

import faulthandler
import os
import sys

TEARDOWN_TIMEOUT_S = 10.0


def bound_teardown(timeout: float = TEARDOWN_TIMEOUT_S) -> None:
    """Past `timeout` seconds from now: every thread's stack to stderr, then exit code 1. Call it
    once the process's shutdown is complete; it replaces any earlier dump_traceback_later."""
    sys.stderr.flush()
    faulthandler.dump_traceback_later(timeout, exit=True, file=sys.stderr)


def end_process(code: int) -> None:
    """Ends the process now with `code`, after flushing stdout and stderr (the JSON logs): the
    interpreter's finalization is skipped (see the module's docstring)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced: nothing left to write
            pass
    os._exit(code)
