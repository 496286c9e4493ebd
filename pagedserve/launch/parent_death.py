"""A child of `serve` dies with it: it asks the kernel for SIGTERM when serve exits (Linux
PR_SET_PDEATHSIG), so nothing is orphaned even when serve is killed with SIGKILL.

The child makes the request itself, first thing in `pagedserve.cli.main`, rather than serve doing
it between fork and exec (subprocess's preexec_fn): that would run Python code, and the at-fork
handlers of gRPC (serve polls the scheduler over gRPC), in a forked copy of a multithreaded
process. serve names its pid in the child's environment; a child whose parent is already someone
else (serve died before the request) stops at once.

The signal follows the thread that started the child: serve starts every child on its main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal

SERVE_PID_ENV = "PAGEDSERVE_SERVE_PID"
PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None) -> dict[str, str]:
    """The environment of a child of this process: env (default: this process's) naming this pid."""
    return {**(os.environ if env is None else env), SERVE_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with child_env: SIGTERM when its parent exits. Elsewhere: nothing."""
    parent = os.environ.pop(SERVE_PID_ENV, None)  # not inherited by this process's own children
    if parent is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux/glibc: no orphan protection
        return
    if os.getppid() != int(parent):  # serve died before the request: nobody would send the signal
        os.kill(os.getpid(), signal.SIGTERM)
