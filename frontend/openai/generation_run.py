"""The Generations of one HTTP request, run on worker threads and read from the event loop.

Generation.run() is a blocking iterator over the scheduler's gRPC stream (the same one the gRPC
servicer iterates). The HTTP server is asyncio: each Generation gets a pump thread that iterates
it and posts every update into one asyncio queue of the request, tagged with the prompt's index:

```
 pump thread (per prompt)                      event loop (the HTTP handler)
   for update in generation.run():  ──post──▶  queue ──▶ next() -> (prompt index, update)
   end / failure                    ──post──▶            None when every prompt ended; a failure
   admission.leave()                                     cancels the others and raises
 cancel() (client gone) ──▶ Generation.cancel() ──▶ Submit stream closed: aborted in the scheduler
```

A pump owns its request's metrics and log lines: `request_finished` with the last update, or
the failure path shared with gRPC (Admission.failed: `request_cancelled`, `request_cut_by_drain`,
`stream_backlog_exceeded` or `request_failed`), whose classified error the handler then raises
(RequestFailed).

The queue holds what the client has not taken yet. A client that stops reading stalls the
handler's writes while the pumps go on, so the run counts the updates posted and not yet read:
past `max_undelivered` (--max-undelivered-messages) the pump that posted the last one aborts its
request in the scheduler (blocks freed), logs `stream_backlog_exceeded` and fails the run with
UndeliveredOutputExceeded (429 / RESOURCE_EXHAUSTED), whatever the write timeout.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import structlog

from pagedserve.frontend.generation.admission import Admission
from pagedserve.frontend.generation.generation import Generation
from pagedserve.frontend.generation.updates import GenerationUpdate, Usage
from pagedserve.frontend.metrics import RequestTimer
from pagedserve.frontend.generation.errors import RequestFailed, UndeliveredOutputExceeded
from pagedserve.frontend.openai.errors import http_status
from pagedserve.frontend.grpc.validation import ValidatedRequest

log = structlog.get_logger()
_END = object()


@dataclass(frozen=True, slots=True)
class _Failure:
    error: BaseException


class GenerationRun:
    """Started with `start()`; read with `await next()`; `cancel()` from the loop at any time."""

    def __init__(self, admission: Admission, executor: Executor, loop: asyncio.AbstractEventLoop,
                 on_pump_end: Callable[[], None] | None = None, max_undelivered: int | None = None) -> None:
        """max_undelivered: updates posted and not yet read, beyond which a request is aborted
        (None: no bound)."""
        self._admission = admission
        self._on_pump_end = on_pump_end  # called on the pump thread once its Generation has left
        self._executor = executor
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.generations: list[Generation] = []
        self.usages: dict[int, Usage] = {}  # prompt index -> usage, once that prompt has ended
        self._num_running = 0
        self._is_cancelled = False
        self._max_undelivered = max_undelivered
        self._num_undelivered = 0  # updates posted, not yet returned by next()
        self._undelivered_lock = threading.Lock()

    @property
    def is_finished(self) -> bool:
        return self._num_running == 0

    def start(self, requests: list[ValidatedRequest], timers: list[RequestTimer], *, whole: bool = False) -> None:
        """Admits every request (all or none: Draining cancels those already admitted) and starts
        their pumps. whole: the response is sent when every prompt has ended, not streamed."""
        for request, timer in zip(requests, timers, strict=True):
            try:
                self.generations.append(self._admission.start(request, timer, whole=whole))
            except BaseException:
                for generation in self.generations:
                    generation.cancel()
                    self._admission.leave(generation)
                self.generations.clear()
                raise
        self._num_running = len(self.generations)
        for index, (generation, timer) in enumerate(zip(self.generations, timers)):
            context = contextvars.copy_context()  # the request id and protocol bound to its log lines
            self._executor.submit(context.run, self._pump, index, generation, timer)

    async def next(self) -> tuple[int, GenerationUpdate] | None:
        """The next update of any prompt, or None once every prompt has ended."""
        while self._num_running:
            index, item = await self._queue.get()
            if item is _END:
                self._num_running -= 1
                continue
            if isinstance(item, _Failure):
                self._num_running -= 1
                self.cancel()
                raise item.error
            with self._undelivered_lock:
                self._num_undelivered -= 1
            if item.usage is not None:
                self.usages[index] = item.usage
            return index, item
        return None

    async def collect(self) -> None:
        """Reads every update (the whole answer is then in each Generation's states)."""
        while await self.next() is not None:
            pass

    def cancel(self) -> None:
        """Aborts every prompt still running (its scheduler stream is closed)."""
        self._is_cancelled = True
        for generation in self.generations:
            generation.cancel()

    # -- on the pump threads -------------------------------------------------------------------
    def _pump(self, index: int, generation: Generation, timer: RequestTimer) -> None:
        try:
            for update in generation.run():
                if update.usage is not None:
                    self._admission.finished(generation, timer, update.usage)
                self._post(index, update, generation)
                self._check_backlog()
            self._post(index, _END, generation)
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the handler
            error = self._admission.failed(exc, timer, generation, code_of=http_status)
            self._post(index, _Failure(RequestFailed(error)), generation)
        finally:
            self._admission.leave(generation)
            if self._on_pump_end is not None:
                self._on_pump_end()

    def _check_backlog(self) -> None:
        with self._undelivered_lock:
            self._num_undelivered += 1
            num_undelivered = self._num_undelivered
        if self._max_undelivered is not None and num_undelivered > self._max_undelivered:
            raise UndeliveredOutputExceeded(num_undelivered, self._max_undelivered)

    def _post(self, index: int, item, generation: Generation) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, item))
        except RuntimeError:  # the event loop has closed: nobody reads this request any more
            generation.cancel()
