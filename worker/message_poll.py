"""The worker's check for a waiting message as a C call: libzmq's zmq_poll (the library pyzmq
links) on the plan socket with a timeout of 0, which a decode run's steps in one native call make
before each step (worker/decode_run.py LaterSteps.many), as the Python loop asks its zmq Poller.

    poll = NativePoll.for_socket(sub)   # None: no zmq_poll found; the run's steps then go one by one
    poll.args                           # (zmq_poll's address, the poll item's): decode_run.c's poll, poll_item

The call and its socket are used by the thread that owns the socket only (the worker's step loop).
"""

from __future__ import annotations

import ctypes

import zmq


class _PollItem(ctypes.Structure):  # zmq_pollitem_t on POSIX systems (zmq.h)
    _fields_ = [("socket", ctypes.c_void_p), ("fd", ctypes.c_int), ("events", ctypes.c_short),
                ("revents", ctypes.c_short)]


def _zmq_poll_address() -> int | None:
    try:
        from zmq.backend.cython import _zmq

        return ctypes.cast(ctypes.CDLL(_zmq.__file__).zmq_poll, ctypes.c_void_p).value
    except (ImportError, OSError, AttributeError):
        return None


class NativePoll:
    """zmq_poll(item, 1, 0) on one socket, as a function's address and its argument's."""

    def __init__(self, function: int, socket: zmq.Socket) -> None:
        self._socket = socket  # kept alive with the item that points to it
        self._item = _PollItem(socket=socket.underlying, fd=0, events=zmq.POLLIN, revents=0)
        self.args = (function, ctypes.addressof(self._item))

    @classmethod
    def for_socket(cls, socket: zmq.Socket) -> "NativePoll | None":
        """The check on socket, or None where pyzmq's libzmq has no zmq_poll to call (its Cython
        backend not in use)."""
        function = _zmq_poll_address()
        return cls(function, socket) if function else None
