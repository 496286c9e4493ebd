"""One request's outputs on their way to its frontend, bounded in bytes.

The engine's loop thread produces an output per request per step whether or not the frontend
reads its Submit stream; gRPC takes messages only as fast as the frontend reads them (HTTP/2 flow
control), so the rest waits here. Without a bound a frontend that stops reading (stuck, or
paused in a debugger) makes the scheduler hold every remaining step of the request, up to
max_tokens times n times its logprobs, and keeps the request's blocks in use meanwhile.

    engine (per step) ──put──▶ [ encoded messages, num_bytes ] ──get──▶ Submit stream ──▶ frontend
                                                                 take_ready (on_ready) ──▶ Session stream
                                      │ num_bytes > max_bytes with an earlier message still unread
                                      ▼
                               on_overflow()  (the request is aborted: its blocks are freed)
                               the queue is emptied, get() returns OutputOverflow

Messages are encoded when they arrive, so their size is known; a single message larger than the
cap is let through (it is what one step produced): the cap applies to what piles up behind it.
Everything here runs on the event loop (the engine's dispatch crosses to it: loop_dispatch).

A request submitted with `hold_output` (its client takes the whole result at the end, and the
frontend has no stop string to look for) is sent as few messages: its first output at once (the
frontend's time to first token, and the sign the request runs), then the later outputs merged
into one, sent when the request finishes, when an exception ends it, or once it holds
HOLD_MAX_TOKENS tokens. One message per step costs the scheduler, the frontend and the client
each a thread wake-up and a message's encoding per token; held, a request costs that twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.contracts.request_types import CompletionDelta, RequestOutput
from pagedserve.contracts.scheduler_codec import output_to_proto
from pagedserve.internal import scheduler_pb2

DEFAULT_MAX_UNDELIVERED_BYTES = 16 << 20
# a held request's merged output goes out at the latest once it holds this many tokens (all
# completions together), so what waits here stays small whatever max_tokens is
HOLD_MAX_TOKENS = 256


class OutputOverflow(RuntimeError):
    """The frontend left more than max_bytes of a request's output unread: the request was aborted."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One output ready to send: the engine's RequestOutput and its encoded message."""

    output: RequestOutput
    message: scheduler_pb2.SubmitResponse
    num_bytes: int


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output saying what `earlier` and then `later` said: each completion's tokens and
    logprobs joined, its cumulative logprob and finish reason the latest. `earlier` is reused
    (it must be merge_outputs' own, not the engine's); `later` is left as it is."""
    deltas = {delta.index: delta for delta in earlier.deltas}
    for delta in later.deltas:
        held = deltas.get(delta.index)
        if held is None:
            deltas[delta.index] = _own_delta(delta)
            continue
        held.token_ids.extend(delta.token_ids)
        held.logprobs.extend(delta.logprobs)
        held.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            held.finish_reason = delta.finish_reason
    earlier.deltas = [deltas[index] for index in sorted(deltas)]
    earlier.prompt_tokens = later.prompt_tokens
    earlier.cached_prompt_tokens = later.cached_prompt_tokens
    earlier.is_finished = later.is_finished
    return earlier


def _own_delta(delta: CompletionDelta) -> CompletionDelta:
    return CompletionDelta(delta.index, list(delta.token_ids), list(delta.logprobs), delta.cumulative_logprob,
                           delta.finish_reason)


class UndeliveredOutput:
    def __init__(self, max_bytes: int, on_overflow: Callable[[], None], *, hold: bool = False,
                 on_ready: Callable[[], None] | None = None) -> None:
        """hold: the request's outputs after its first are merged (the module's docstring).
        on_ready: called whenever something is queued (a Session's writer then takes it: take_ready)."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, not {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0  # encoded bytes queued, not yet taken by get()
        self.has_overflowed = False
        self.hold = hold
        self._on_overflow = on_overflow
        self._on_ready = on_ready
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_outputs = 0  # outputs the engine gave
        self._held: RequestOutput | None = None  # hold: the merged outputs not queued yet
        self._num_held_tokens = 0

    def put(self, item: RequestOutput | Exception) -> None:
        """The engine's sink for this request (on the event loop)."""
        if self.has_overflowed:
            return  # aborted already: what the engine sent before it saw the abort is dropped
        if isinstance(item, Exception):
            self._release_held()
            if not self.has_overflowed:
                self._queue.put_nowait(item)
                self._signal()
            return
        self._num_outputs += 1
        if not self.hold or self._num_outputs == 1:
            self._enqueue(item)
            return
        if self._held is None:
            self._held = RequestOutput(item.request_id, [], item.prompt_tokens, item.cached_prompt_tokens, False)
        merge_outputs(self._held, item)
        self._num_held_tokens += sum(len(delta.token_ids) for delta in item.deltas)
        if item.is_finished or self._num_held_tokens >= HOLD_MAX_TOKENS:
            self._release_held()

    def _release_held(self) -> None:
        held, self._held, self._num_held_tokens = self._held, None, 0
        if held is not None:
            self._enqueue(held)

    def _enqueue(self, item: RequestOutput) -> None:
        message = output_to_proto(item)
        size = message.ByteSize()
        if self.num_bytes + size > self.max_bytes and not self._queue.empty():
            self._overflow()
            return
        self.num_bytes += size
        self._queue.put_nowait(Delivery(item, message, size))
        self._signal()

    async def get(self) -> Delivery | Exception:
        """The next output, or the exception that ends the stream (OutputOverflow, or the engine's)."""
        item = await self._queue.get()
        if isinstance(item, Delivery):
            self.num_bytes -= item.num_bytes
        return item

    def take_ready(self, max_bytes: int) -> tuple[list[Delivery | Exception], int]:
        """What is queued now, oldest first, without waiting, up to max_bytes of messages (the first
        one whatever its size); and their bytes. `has_ready` tells whether some were left."""
        items, taken = [], 0
        while not self._queue.empty():
            item = self._queue._queue[0]  # noqa: SLF001  (peeked: asyncio.Queue has no peek)
            size = item.num_bytes if isinstance(item, Delivery) else 0
            if items and taken + size > max_bytes:
                break
            self._queue.get_nowait()
            self.num_bytes -= size
            taken += size
            items.append(item)
        return items, taken

    @property
    def has_ready(self) -> bool:
        return not self._queue.empty()

    def _signal(self) -> None:
        if self._on_ready is not None:
            self._on_ready()

    def _overflow(self) -> None:
        num_bytes = self.num_bytes
        self.has_overflowed = True
        while not self._queue.empty():  # never sent now: the memory goes at once
            self._queue.get_nowait()
        self.num_bytes = 0
        self._queue.put_nowait(OutputOverflow(
            f"the frontend left more than {self.max_bytes} bytes of this request's output unread "
            f"({num_bytes} queued): the request was aborted"))
        self._signal()
        self._on_overflow()
