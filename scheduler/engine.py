"""The scheduler process's step loop: one thread owns the Scheduler and the worker link.

    gRPC threads --commands (submit, abort, finish), reads--> loop_commands.py --> step loop thread
    step loop:  apply commands -> schedule() -> publish plan N
                -> hand step N-1's outputs to the dispatcher (while the workers run step N)
                -> rank 0's result N -> process_result() -> outputs held for the next step
                (idle: hand over what is held, wait for a command)

Outputs go out in one batch per step through `dispatch`, a callable given a list of (sink, item)
pairs: the gRPC server turns it into one wake-up of its event loop per step instead of one per
request. Handing a step's outputs over after the next plan is published lets the server stream
them while the workers compute, instead of holding the loop thread back from scheduling.

A lost worker: with worker_recovery_timeout > 0 (serve restarts its workers) the Scheduler is
reset: every block is dropped and each unfinished request waits to be computed again from the
tokens it holds; when the ranks register again the streams continue where they were. Requests
still waiting when the timeout passes, or all of them at once without recovery, fail UNAVAILABLE.

`on_step` runs for every step (and with no record when a new Scheduler starts): for a step that
another follows, right after the next plan is published (while the workers run it, off the path
from a result to the next plan), else before the loop goes idle or hands over a lost worker's
requests; `on_idle` at
most every IDLE_REPORT_SECONDS while no step runs, workers ready or not, so what the gauges show
follows an abort, a finish or a reset within a second even when no further step comes.

Nothing but the loop thread touches the Scheduler, so it needs no locks.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from pagedserve.log import get_logger
from pagedserve.contracts.request_types import Request, RequestOutput
from pagedserve.scheduler.core.admission import Admission
from pagedserve.scheduler.core.errors import RequestFailed, SchedulerConfigError
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.loop_commands import LoopCommands
from pagedserve.scheduler.worker_link import PoolSize, WorkerLink, WorkerLost
from pagedserve.scheduler.structured_output.compiler import GrammarCompiler

Sink = Callable[[RequestOutput | Exception], None]
Dispatch = Callable[[list[tuple[Sink, RequestOutput | Exception]]], None]
MAX_RECENT_STEPS = 256
MAX_CRASHES_IN_FLIGHT = 2  # a request in flight during this many consecutive worker crashes fails
IDLE_REPORT_SECONDS = 0.25


class EngineUnavailable(RuntimeError):
    """Workers are not (or no longer) ready, or the engine is draining."""


@dataclass(slots=True)
class StepRecord:
    step_id: int
    request_ids: list[str]
    num_prefill_tokens: int
    num_decode_tokens: int
    seconds: float
    forward_seconds: float = 0.0  # rank 0's model forward within the step
    queue_seconds: list[float] = field(default_factory=list)  # requests scheduled for the first time


@dataclass
class EngineState:
    is_ready: bool = False
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    num_waiting: int = 0
    recent_steps: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=MAX_RECENT_STEPS))


class Engine:
    def __init__(self, config: SchedulerConfig, link: WorkerLink,
                 on_step: Callable[["Engine", StepRecord | None], None] | None = None,
                 dispatch: Dispatch | None = None,
                 on_idle: Callable[["Engine"], None] | None = None,
                 grammars: GrammarCompiler | None = None) -> None:
        """config.num_gpu_blocks caps the pool the workers offer (None: all of it); its
        max_model_len must be known. dispatch: runs a batch of (sink, item) pairs; by default each
        sink is called in turn on the loop thread."""
        if config.max_model_len is None:
            raise SchedulerConfigError("max_model_len", "must be known before the engine starts")
        self.config = config
        self.link = link
        self.grammars = grammars  # structured output: compiles constraints (None: refused)
        self.state = EngineState()
        self.scheduler = None
        self._on_step = on_step
        self._unreported: StepRecord | None = None  # the last step's record, not yet given to on_step
        self._on_idle = on_idle
        self._next_idle_report = 0.0
        self._commands = LoopCommands(on_command=self._end_run_in_flight)
        self._stopping = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._dispatch: Dispatch = dispatch or _call_each
        self._held: list[tuple[Sink, RequestOutput | Exception]] = []  # outputs of the last step
        self._recovery_deadline: float | None = None
        self._in_flight_ids: list[str] = []  # requests of the step the workers are computing
        self._run_in_flight = False  # that step is a decode run: a new command ends it early
        self._crash_counts: dict[str, int] = {}  # consecutive worker crashes each was in flight for
        self.admission = Admission(config.max_waiting_requests, config.max_waiting_tokens)
        self._thread = threading.Thread(target=self._run, name="step-loop", daemon=True)
        self._log = get_logger(component="engine")

    # ---- thread-safe API ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._commands.wakeup.set()
        self._thread.join(timeout)

    def submit(self, request: Request, sink: Sink) -> None:
        if not self.state.is_ready:
            raise EngineUnavailable("workers are not ready")
        self.admission.admit(request.request_id, len(request.prompt_token_ids))
        self._commands.post(lambda: self._add(request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.post(lambda: self._abort(request_id))

    def finish_completion(self, request_id: str, index: int) -> None:
        self._commands.post(lambda: self.scheduler is not None
                   and self.scheduler.finish_completion(request_id, index))

    def call(self, fn: Callable[[], object], timeout: float = 10.0) -> object:
        """Runs fn on the loop thread between steps and returns its result: a read of the state
        (loop_commands.py), which waits for a decode run in flight to end instead of ending it."""
        try:
            return self._commands.read(fn, timeout)
        except TimeoutError as exc:
            raise EngineUnavailable(str(exc)) from exc

    def _end_run_in_flight(self) -> None:
        """A command was posted: a decode run in flight ends after its current step (worker_link.py)."""
        if self._run_in_flight:
            self.link.interrupt()

    # ---- loop thread -------------------------------------------------------------------------

    def _add(self, request: Request, sink: Sink) -> None:
        if self.scheduler is None or not self.state.is_ready:
            self.admission.release(request.request_id)
            self._dispatch([(sink, EngineUnavailable("workers are not ready"))])
            return
        try:
            self.scheduler.add_request(request)
        except Exception as exc:  # RequestRejected and bad input go back to that caller only
            self.admission.release(request.request_id)
            self._dispatch([(sink, exc)])
            return
        self._sinks[request.request_id] = sink
        if self.scheduler.config.is_speculating and request.sampling.is_beam_search:
            self._log.info("speculation_not_applied", request_id=request.request_id, reason="beam_search")

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._forgive(request_id)
        self.admission.release(request_id)
        if self.scheduler is not None:
            self.scheduler.abort_request(request_id)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self.state.is_ready:
                    self._start_workers()
                    self._report_idle()
                    continue
                self._commands.apply()
                if not self._step():
                    self._hand_over()
                    self._report_idle()
                    self.link.drain()
                    self.link.check_alive()
                    self._commands.wakeup.wait(0.05)
                    self._commands.wakeup.clear()
            except WorkerLost as exc:
                self._lose_workers(str(exc))
            except Exception:
                self._log.exception("step_loop_failed")
                self._lose_workers("the step loop failed")
        self.link.shutdown_workers("scheduler stopping")
        self._fail_all(EngineUnavailable("the scheduler is stopping"))

    def _start_workers(self) -> None:
        self._commands.apply()
        if self._recovery_deadline is not None and time.monotonic() > self._recovery_deadline:
            self._give_up_recovery("workers did not come back in time")
        if not self.link.all_registered():
            self.link.poll_registration(0.1)
            return
        deadline = time.monotonic() + self.config.startup_timeout
        pool = self.link.init_cache(self.config.num_gpu_blocks, deadline)
        if self.scheduler is not None and (pool.num_gpu_blocks, pool.num_cpu_blocks) != (
                self.state.num_gpu_blocks, self.state.num_cpu_blocks):
            self._give_up_recovery("the restarted workers have a different KV pool size")
        is_new_scheduler = self.scheduler is None
        if is_new_scheduler:
            self.scheduler = self._new_scheduler(pool)
        else:
            self._log.info("requests_resumed", num_requests=len(self._sinks))
        self._recovery_deadline = None
        self.state.num_gpu_blocks = pool.num_gpu_blocks
        self.state.num_cpu_blocks = pool.num_cpu_blocks
        self.state.is_ready = True
        self._log.info("workers_ready", epoch=self.link.epoch, num_gpu_blocks=pool.num_gpu_blocks,
                       num_cpu_blocks=pool.num_cpu_blocks, world_size=self.link.world_size)
        if is_new_scheduler and self._on_step is not None:
            self._on_step(self, None)  # counters restart with a new scheduler

    def _report_idle(self) -> None:
        now = time.monotonic()
        if self._on_idle is not None and now >= self._next_idle_report:
            self._next_idle_report = now + IDLE_REPORT_SECONDS
            self._on_idle(self)

    def _give_up_recovery(self, reason: str) -> None:
        self._log.error("recovery_abandoned", reason=reason, num_requests=len(self._sinks))
        self._recovery_deadline = None
        self.scheduler = None
        self._fail_all(EngineUnavailable(f"workers lost: {reason}"))

    def _new_scheduler(self, pool: PoolSize):
        """A Scheduler over the pool the workers offer, with their KV tiers (the disk tier's index
        is read from its folder now: scheduler/kv/tiers)."""
        from pagedserve.scheduler.core.scheduler import Scheduler

        return Scheduler(replace(self.config, num_gpu_blocks=pool.num_gpu_blocks, num_cpu_blocks=pool.num_cpu_blocks,
                                 num_host_blocks=pool.num_host_blocks, kv_layout_id=pool.kv_layout_id,
                                 num_kv_block_bytes=pool.num_bytes_per_block, num_kv_ranks=self.link.world_size),
                         grammars=self.grammars)

    def _step(self) -> bool:
        started = time.perf_counter()
        scheduled = self.scheduler.schedule(defer_masks=True)
        if scheduled is None:
            self._report_step()
            self._hold(self.scheduler.pop_pending_outputs())
            self.state.num_waiting = len(self.scheduler.waiting)
            return False
        now = time.monotonic()
        queue_seconds = [seconds for group in scheduled.groups
                         if (seconds := self.admission.release(group.request_id, now)) is not None]
        self._in_flight_ids = [group.request_id for group in scheduled.groups]
        self._run_in_flight = scheduled.plan.num_steps > 1
        self.link.publish(scheduled.plan)
        if self._run_in_flight and self._commands.has_commands():  # came after this plan was built
            self.link.interrupt()
        if scheduled.pending_masks:  # while the workers run the forward; rank 0 waits before sampling
            scheduled.fill_masks()
            self.link.publish_masks(scheduled.plan)
        self._report_step()  # the previous step's, while the workers run this one
        self._hand_over()
        try:
            result = self.link.wait_result(scheduled.plan)
            while result.run_step:  # a step of a run that streams them: its tokens go out now
                self._hold(self.scheduler.process_run_step(scheduled, result))
                self._hand_over()
                result = self.link.wait_result(scheduled.plan, in_run=True)
        finally:
            self._run_in_flight = False
        self._hold(self.scheduler.process_result(scheduled, result))
        for failure in self.scheduler.pop_failures():
            self._fail_request(failure.request_id, failure.message)
        if self._crash_counts:  # they survived a step: their crash streak ends
            for request_id in self._in_flight_ids:
                self._forgive(request_id)
        self._in_flight_ids = []
        record = self._record(scheduled, time.perf_counter() - started)
        record.forward_seconds = result.forward_seconds
        record.queue_seconds = queue_seconds
        self.state.num_waiting = len(self.scheduler.waiting)
        self._unreported = record
        return True

    def _report_step(self) -> None:
        record, self._unreported = self._unreported, None
        if record is not None and self._on_step is not None and self.scheduler is not None:
            self._on_step(self, record)

    def _hold(self, outputs: list[RequestOutput]) -> None:
        """Pairs outputs with their sinks (a finished request's sink is dropped at once) and keeps
        them for the next hand-over."""
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.is_finished:
                del self._sinks[output.request_id]
                self._forgive(output.request_id)
            self._held.append((sink, output))

    def _fail_request(self, request_id: str, message: str) -> None:
        """One request fails (INTERNAL to its caller); the scheduler has already dropped it."""
        self._log.error("request_failed", request_id=request_id, error=message)
        self.admission.release(request_id)
        self._forgive(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            self._held.append((sink, RequestFailed(message)))

    def _forgive(self, request_id: str) -> None:
        if self._crash_counts.pop(request_id, None) is not None and self.scheduler is not None:
            self.scheduler.isolated_request_ids.discard(request_id)

    def _quarantine_step_requests(self) -> None:
        """The workers crashed while computing a step: each request in it counts one more crash
        and is replayed in steps with no other such suspect (Scheduler.isolated_request_ids), so
        a crash after that has one suspect; one at MAX_CRASHES_IN_FLIGHT is failed instead of
        replayed, and a request that crashes the workers cannot put them in a restart loop."""
        for request_id in self._in_flight_ids:
            count = self._crash_counts.get(request_id, 0) + 1
            if count < MAX_CRASHES_IN_FLIGHT:
                self._crash_counts[request_id] = count
                if self.scheduler is not None:
                    self.scheduler.isolated_request_ids.add(request_id)
                continue
            if self.scheduler is not None:
                self.scheduler.abort_request(request_id)
            self._fail_request(request_id, f"in flight during {count} consecutive worker crashes; "
                                           "not replayed again")
        self._in_flight_ids = []

    def _hand_over(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self._dispatch(held)

    def _record(self, scheduled, seconds: float) -> StepRecord:
        request_ids = sorted({group.request_id for group in scheduled.groups})
        record = StepRecord(scheduled.plan.step_id, request_ids, scheduled.num_prefill_tokens,
                            scheduled.num_decode_tokens, seconds)
        self.state.recent_steps.append(record)
        return record

    def _lose_workers(self, reason: str) -> None:
        self._log.error("workers_lost", reason=reason)
        try:
            self._report_step()
        except Exception:  # the metrics of one step must not stop the recovery
            self._log.exception("step_report_failed")
        self._quarantine_step_requests()
        self._hand_over()  # tokens already computed go out now, not after the recovery
        self.state.is_ready = False
        self.link.forget_ranks()
        timeout = self.config.worker_recovery_timeout
        if timeout > 0 and self.scheduler is not None and self._recovery_deadline is None:
            self.scheduler.reset()
            self._recovery_deadline = time.monotonic() + timeout
            self._log.warning("requests_held_for_recovery", num_requests=len(self._sinks),
                              timeout_seconds=timeout)
            return
        if self._recovery_deadline is None:
            self._fail_all(EngineUnavailable(f"workers lost: {reason}"))
            self.scheduler = None

    def _fail_all(self, error: Exception) -> None:
        self._hand_over()  # what the last step produced goes out before the failure
        sinks, self._sinks = self._sinks, {}
        self.admission.clear()
        if sinks:
            self._dispatch([(sink, error) for sink in sinks.values()])


def _call_each(pairs: list[tuple[Sink, RequestOutput | Exception]]) -> None:
    for sink, item in pairs:
        sink(item)
