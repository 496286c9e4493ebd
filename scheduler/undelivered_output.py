"""One request's outputs on their way to its frontend, bounded in bytes.

The engine's loop thread produces an output per request per step whether or not the frontend
reads its Submit stream; gRPC takes messages only as fast as the frontend reads them (HTTP/2 flow
control), so the rest waits here. Without a bound a frontend that stops reading (stuck, or
paused in a debugger) makes the scheduler hold every remaining step of the request, up to
max_tokens times n times its logprobs, and keeps the request's blocks in use meanwhile.

    engine (per step) ──put──▶ [ encoded messages, num_bytes ] ──get──▶ Submit stream ──▶ frontend
                                      │ num_bytes > max_bytes with an earlier message still unread
                                      ▼
                               on_overflow()  (the request is aborted: its blocks are freed)
                               the queue is emptied, get() returns OutputOverflow

Messages are encoded when they arrive, so their size is known; a single message larger than the
cap is let through (it is what one step produced): the cap applies to what piles up behind it.
Everything here runs on the event loop (the engine's dispatch crosses to it: loop_dispatch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.contracts.request_types import RequestOutput
from pagedserve.contracts.scheduler_codec import output_to_proto
from pagedserve.internal import scheduler_pb2

DEFAULT_MAX_UNDELIVERED_BYTES = 16 << 20


class OutputOverflow(RuntimeError):
    """The frontend left more than max_bytes of a request's output unread: the request was aborted."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One output ready to send: the engine's RequestOutput and its encoded message."""

    output: RequestOutput
    message: scheduler_pb2.SubmitResponse
    num_bytes: int


class UndeliveredOutput:
    def __init__(self, max_bytes: int, on_overflow: Callable[[], None]) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, not {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0  # encoded bytes queued, not yet taken by get()
        self.has_overflowed = False
        self._on_overflow = on_overflow
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | Exception) -> None:
        """The engine's sink for this request (on the event loop)."""
        if self.has_overflowed:
            return  # aborted already: what the engine sent before it saw the abort is dropped
        if isinstance(item, Exception):
            self._queue.put_nowait(item)
            return
        message = output_to_proto(item)
        size = message.ByteSize()
        if self.num_bytes + size > self.max_bytes and not self._queue.empty():
            self._overflow()
            return
        self.num_bytes += size
        self._queue.put_nowait(Delivery(item, message, size))

    async def get(self) -> Delivery | Exception:
        """The next output, or the exception that ends the stream (OutputOverflow, or the engine's)."""
        item = await self._queue.get()
        if isinstance(item, Delivery):
            self.num_bytes -= item.num_bytes
        return item

    def _overflow(self) -> None:
        num_bytes = self.num_bytes
        self.has_overflowed = True
        while not self._queue.empty():  # never sent now: the memory goes at once
            self._queue.get_nowait()
        self.num_bytes = 0
        self._queue.put_nowait(OutputOverflow(
            f"the frontend left more than {self.max_bytes} bytes of this request's output unread "
            f"({num_bytes} queued): the request was aborted"))
        self._on_overflow()
