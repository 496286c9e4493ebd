"""Runs Triton kernels under the interpreter in a child process, for tests without CUDA.

TRITON_INTERPRET is read when triton's own modules and every @triton.jit decorator are imported,
and an interpreted kernel breaks when triton itself was imported without it (its standard-library
jit functions then refuse to run outside a compiled kernel). So the interpreter is a choice per
process. Setting it in the pytest process would depend on import order and would change triton for
every other test folder; instead a child Python started with TRITON_INTERPRET=1 runs the kernels:

    test process                                     child (python this_file.py, TRITON_INTERPRET=1)
    call("pkg.module:function", *args) ── pickle ──▶ import, run, pickle (status, result, args) back
    copy returned args into the caller's tensors ◀──   (so in-place kernels such as cache writes
                                                        act as if they ran in the test process)

Tensors travel by value through a private pipe (no shared memory, which small /dev/shm mounts in
containers would limit). An exception in the child is re-raised in the test process as the same
type, with the child's traceback attached as a note.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import torch


_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class _Pickler(pickle.Pickler):
    """torch cannot pickle float8 tensors: they travel as uint8 views, viewed back on arrival."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dtype in _FLOAT8_DTYPES:
            return torch.Tensor.view, (obj.view(torch.uint8), obj.dtype)
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


def _resolve(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _copy_back(original: Any, returned: Any) -> None:
    """Writes tensors the child may have modified in place back into the caller's tensors."""
    if isinstance(original, torch.Tensor):
        original.copy_(returned)
    elif isinstance(original, (list, tuple)):
        for item, item_returned in zip(original, returned):
            _copy_back(item, item_returned)


def _run_one(target: str, args: tuple, kwargs: dict, env: dict[str, str]) -> bytes:
    try:
        with _environment(env):
            reply = ("ok", _resolve(target)(*args, **kwargs), args)
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the test that asked
        exc.add_note(f"in the Triton interpreter process:\n{traceback.format_exc()}")
        reply = ("error", exc, None)
    try:
        return _dumps(reply)
    except Exception:  # noqa: BLE001 - an unpicklable exception still has to reach the caller
        return _dumps(("error", RuntimeError(f"{reply[1]!r}\n{traceback.format_exc()}"), None))


def serve(requests: Connection, replies: Connection) -> None:
    if "triton" in sys.modules or os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the interpreter process must start with TRITON_INTERPRET=1, before triton loads")
    while True:
        try:
            message = requests.recv_bytes()
        except EOFError:  # the test process closed the pipe or died
            return
        replies.send_bytes(_run_one(*pickle.loads(message)))


class InterpreterProcess:
    """A child Python that runs `call`s with the Triton interpreter."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(request_read), str(reply_write)],
            pass_fds=(request_read, reply_write), env={**os.environ, "TRITON_INTERPRET": "1"},
        )
        os.close(request_read)
        os.close(reply_write)
        self._requests = Connection(request_write, readable=False)
        self._replies = Connection(reply_read, writable=False)

    def call(self, target: str, *args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
        """Runs `module:function`(*args, **kwargs) in the child, with `env` set for the call.

        A child that dies (a kernel reading unmapped memory segfaults the interpreter) fails this
        call and is replaced, so later calls still run.
        """
        try:
            self._requests.send_bytes(_dumps((target, args, kwargs, env or {})))
            status, value, args_after = pickle.loads(self._replies.recv_bytes())
        except (EOFError, OSError):
            exit_code = self._process.wait()
            self.close()
            self._start()
            raise RuntimeError(f"the Triton interpreter process died (exit code {exit_code}) running "
                               f"{target}") from None
        if status == "error":
            raise value
        _copy_back(args, args_after)
        return value

    def close(self) -> None:
        self._requests.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._replies.close()


class InProcess:
    """The same `call` for machines with CUDA: the compiled kernels run in the test process."""

    def call(self, target: str, *args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> Any:
        with _environment(env or {}):
            return _resolve(target)(*args, **kwargs)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
