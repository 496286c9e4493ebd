"""The scheduler's side of the ZeroMQ link to the workers.

    scheduler PUB  --SchedulerMessage (InitCache | StepPlan | StepMasks | EndRun | Shutdown)-->  SUB  every rank
    scheduler PULL <--WorkerMessage (Register | Ready | StepResult | WorkerError)--  PUSH

Start-up: every rank registers its KV capacity and repeats it every second for as long as it
lives (the registration is also its heartbeat, and a scheduler that restarted learns its ranks
from it); once all ranks of the replica have registered, the pool size is the minimum (or the
operator's override, if smaller) and InitCache is re-published until every rank answers Ready for
that epoch (this also rides out ZeroMQ's slow-joiner loss of the first published messages).
Epochs start from the link's start time in milliseconds, so they never repeat across scheduler
restarts: a worker that outlived a scheduler sees the new one's first epoch as new, and takes
its step numbers afresh.

With CURVE keys in the environment (pagedserve.security.zmq_curve; serve sets them) both sockets are CURVE
servers admitting only the workers' key. Every worker message is checked before it counts: one that does not parse, is empty, registers
a rank outside the replica, or answers a step or epoch other than the one awaited is dropped and
logged (`worker_message_dropped`), never raised into the step loop.

The tensor-parallel ranks are one replica: a step is one plan published to all, and only rank 0
answers. The replica is lost (WorkerLost) when any rank reports an error (a failed collective
means a peer died or stalled), stops sending messages for heartbeat_timeout (checked on a clock
while a step is awaited, so a dead rank cannot leave the loop waiting for rank 0 forever), or
registers again under a new instance id. `forget_ranks` then publishes a Shutdown naming the
instance ids of the replica's processes, so the survivors, whose process group is broken, exit,
while a rank already started to replace the lost one (it may be subscribed by then) stays; the
dismissed instances are ignored for DISMISSED_SECONDS (longer than a rank takes to leave a
collective whose peer died). The replica is ready again once every rank has registered anew (a
new epoch).

Who a rank is: the random 64-bit instance id each worker process draws at start and sends in
every Register and WorkerError, never its pid. Pids repeat across containers (every rank in its
own pod may be pid 1, and a replacement is pid 1 again): keyed by pid, a replacement looked like
the old rank's heartbeat, obeyed the Shutdown meant for the rank it replaced, and was refused as
dismissed. The pid is still logged, to find the process on its host.

A decode run (StepPlan.num_steps > 1) is ended early when a request arrives or leaves meanwhile:
another thread calls `interrupt()` (a byte on a pipe the step loop's poller watches beside the
result socket), and the loop, waiting for the run's result, publishes EndRun; the worker answers
the steps it computed, so the new request waits for one step instead of the whole run.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import zmq
from google.protobuf.message import DecodeError

from pagedserve.internal import step_pb2
from pagedserve.log import get_logger
from pagedserve.contracts.plan_codec import encode_plan, masks_to_proto, result_from_proto
from pagedserve.contracts.step_plan import StepPlan, StepResult
from pagedserve.security.zmq_curve import CurveServer, curve_keys_from_env

INIT_RESEND_SECONDS = 0.2
PLAN_SNDHWM = 1000  # plans queued per subscriber before ZeroMQ drops them for it
CLOSE_LINGER_MS = 500  # lets the last Shutdown reach the workers
DISMISSED_SECONDS = 120.0  # registrations of a process told to exit are ignored this long


class WorkerLost(RuntimeError):
    """A rank stopped answering or reported an error; the replica is not ready."""


@dataclass(slots=True)
class RankState:
    rank: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    device: str
    pid: int  # for log lines: pids repeat across containers
    instance_id: int  # who the process is (see the module docstring)
    last_seen: float
    ready_epoch: int = -1
    num_host_blocks: int = 0  # host KV tier slots
    kv_layout_id: str = ""  # the disk tier's layout ("" without --kv-cache-dir)
    num_bytes_per_block: int = 0


@dataclass(slots=True)
class PoolSize:
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_host_blocks: int = 0
    kv_layout_id: str = ""  # every rank's, when they agree; "" otherwise (no disk tier)
    num_bytes_per_block: int = 0  # one rank's block


@dataclass
class WorkerLink:
    plan_address: str
    result_address: str
    world_size: int
    heartbeat_timeout: float = 10.0
    ranks: dict[int, RankState] = field(default_factory=dict)
    epoch: int = field(default_factory=lambda: time.time_ns() // 1_000_000)  # see the module docstring
    dismissed_instances: dict[int, float] = field(default_factory=dict)  # instance id told to exit -> when
    num_dropped: int = 0  # worker messages dropped: unparsable, empty, or not expected

    def __post_init__(self) -> None:
        self._context = zmq.Context.instance()
        keys = curve_keys_from_env()
        self._curve = CurveServer(self._context, keys) if keys is not None else None
        if self._curve is None:
            get_logger(component="worker_link").warning(
                "internal_zmq_unauthenticated", hint="serve sets CURVE keys for its children (docs/security.md)")
        self._pub = self._context.socket(zmq.PUB)
        if self._curve is not None:
            self._curve.secure(self._pub)
        # bounded: a subscriber that stops reading loses plans (and stops on the gap) instead of
        # growing the scheduler's memory without end
        self._pub.setsockopt(zmq.SNDHWM, PLAN_SNDHWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.plan_address)
        self._pull = self._context.socket(zmq.PULL)
        if self._curve is not None:
            self._curve.secure(self._pull)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.result_address)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._wake_read, self._wake_write = os.pipe()  # interrupt(): from any thread
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._interrupted = False

    def interrupt(self) -> None:
        """Thread-safe: the decode run being awaited, if any, should end after its current step."""
        wake = self._wake_write
        if wake is None:
            return  # closed
        try:
            os.write(wake, b"!")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    # ---- receiving -------------------------------------------------------------------------

    def _receive(self, timeout: float) -> step_pb2.WorkerMessage | None:
        """The next worker message, or None when none came in time or the one that came was
        dropped (not a WorkerMessage: logged, never raised, so a stray frame cannot stop the loop)."""
        events = dict(self._poller.poll(max(0, int(timeout * 1000))))
        if self._wake_read in events:
            self._interrupted = True
            while True:
                try:
                    if not os.read(self._wake_read, 4096):
                        break
                except BlockingIOError:
                    break
        if self._pull not in events:
            return None
        frame = self._pull.recv()
        message = step_pb2.WorkerMessage()
        try:
            message.ParseFromString(frame)
        except DecodeError as exc:
            self._drop("unparsable", num_bytes=len(frame), error=str(exc))
            return None
        if message.WhichOneof("kind") is None:
            self._drop("empty", num_bytes=len(frame))
            return None
        return message

    def _drop(self, reason: str, **fields) -> None:
        self.num_dropped += 1
        get_logger(component="worker_link").warning("worker_message_dropped", reason=reason,
                                                    num_dropped=self.num_dropped, **fields)

    def _note(self, message: step_pb2.WorkerMessage) -> StepResult | None:
        """Updates rank state from one message; returns a step result when it is one."""
        kind = message.WhichOneof("kind")
        now = time.monotonic()
        if kind == "register":
            self._note_register(message.register, now)
            return None
        rank = {"ready": lambda: message.ready.rank, "error": lambda: message.error.rank,
                "step_result": lambda: 0}[kind]()
        state = self.ranks.get(rank)
        if kind == "error" and (state is None or message.error.instance_id not in (0, state.instance_id)):
            # a rank of a replica already given up on, reporting late
            get_logger(component="worker_link").info(
                "late_worker_error", rank=rank, pid=message.error.pid,
                instance_id=f"{message.error.instance_id:016x}", message=message.error.message)
            return None
        if state is not None:
            state.last_seen = now
        if kind == "error":
            raise WorkerLost(f"worker rank {rank} (pid {state.pid}) failed: "
                             f"{message.error.message}; {self.last_heard()}")
        if kind == "ready" and state is not None:
            state.ready_epoch = message.ready.epoch
        if kind == "step_result":
            try:
                return result_from_proto(message.step_result)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                self._drop("bad_step_result", step_id=message.step_result.step_id, error=str(exc))
                return None
        return None

    def _note_register(self, reg: step_pb2.Register, now: float) -> None:
        if reg.world_size != self.world_size or not 0 <= reg.rank < self.world_size:
            self._drop("unexpected_rank", rank=reg.rank, world_size=reg.world_size, pid=reg.pid,
                       expected_world_size=self.world_size)
            return
        if now - self.dismissed_instances.get(reg.instance_id, -math.inf) < DISMISSED_SECONDS:
            return  # told to exit, not yet gone
        known = self.ranks.get(reg.rank)
        if known is not None and known.instance_id == reg.instance_id:
            known.last_seen = now  # the registration repeated every second: a heartbeat
            return
        if known is not None and known.ready_epoch == self.epoch:
            raise WorkerLost(f"worker rank {reg.rank} registered again as instance "
                             f"{reg.instance_id:016x} (pid {reg.pid}): its serving process "
                             f"(instance {known.instance_id:016x}, pid {known.pid}) is gone")
        self.ranks[reg.rank] = RankState(reg.rank, reg.num_gpu_blocks, reg.num_cpu_blocks,
                                         reg.device, reg.pid, reg.instance_id, now, num_host_blocks=reg.num_host_blocks,
                                         kv_layout_id=reg.kv_layout_id, num_bytes_per_block=reg.num_bytes_per_block)

    def last_heard(self) -> str:
        """'last heard: rank 0 0.1s ago, rank 1 3.0s ago' for log lines."""
        now = time.monotonic()
        heard = ", ".join(f"rank {state.rank} {now - state.last_seen:.1f}s ago"
                          for state in sorted(self.ranks.values(), key=lambda state: state.rank))
        return f"last heard: {heard}"

    def check_alive(self) -> None:
        now = time.monotonic()
        for state in self.ranks.values():
            if now - state.last_seen > self.heartbeat_timeout:
                raise WorkerLost(f"worker rank {state.rank} (pid {state.pid}) sent nothing for "
                                 f"{now - state.last_seen:.1f}s (dead or stopped); {self.last_heard()}")

    # ---- start-up --------------------------------------------------------------------------

    def all_registered(self) -> bool:
        return len(self.ranks) == self.world_size

    def poll_registration(self, timeout: float) -> None:
        message = self._receive(timeout)
        if message is not None:
            self._note(message)

    def init_cache(self, max_gpu_blocks: int | None, deadline: float) -> PoolSize:
        """Publishes InitCache for a new epoch until every rank is ready; returns the pool size."""
        num_gpu = min(state.num_gpu_blocks for state in self.ranks.values())
        if max_gpu_blocks is not None:
            num_gpu = min(num_gpu, max_gpu_blocks)
        num_cpu = min(state.num_cpu_blocks for state in self.ranks.values())
        num_host = min(state.num_host_blocks for state in self.ranks.values())
        layout_ids = {state.kv_layout_id for state in self.ranks.values()}
        self.epoch += 1
        init = step_pb2.SchedulerMessage(init_cache=step_pb2.InitCache(
            epoch=self.epoch, num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu, num_host_blocks=num_host))
        payload = init.SerializeToString()
        while not all(state.ready_epoch == self.epoch for state in self.ranks.values()):
            if time.monotonic() > deadline:
                raise WorkerLost("workers did not allocate their KV cache in time")
            self._pub.send(payload)
            end = time.monotonic() + INIT_RESEND_SECONDS
            while time.monotonic() < end and not all(state.ready_epoch == self.epoch for state in self.ranks.values()):
                message = self._receive(end - time.monotonic())
                if message is not None:
                    self._note(message)
        return PoolSize(num_gpu, num_cpu, num_host, layout_ids.pop() if len(layout_ids) == 1 else "",
                        max(state.num_bytes_per_block for state in self.ranks.values()))

    # ---- steps -----------------------------------------------------------------------------

    def publish(self, plan: StepPlan) -> None:
        """Sends one plan to every rank of the current epoch."""
        plan.epoch = self.epoch
        self._pub.send(encode_plan(plan))

    def publish_masks(self, plan: StepPlan) -> None:
        """Sends the bitmask rows of a plan published with masks_follow."""
        self._pub.send(step_pb2.SchedulerMessage(step_masks=masks_to_proto(plan)).SerializeToString())

    def wait_result(self, plan: StepPlan, poll_seconds: float = 0.5, in_run: bool = False) -> StepResult:
        """Waits for rank 0's result of a published plan, watching every rank's heartbeat; in_run:
        the next result of a run that streams its steps, after one of its steps.

        The heartbeats are checked on a clock, not only when the socket falls silent: the other
        ranks keep heartbeating while a dead one holds the step back.
        """
        next_check = time.monotonic() + poll_seconds
        if not in_run:
            self._interrupted = False  # one noted while idle was for a run already over
        while True:
            message = self._receive(max(0.0, next_check - time.monotonic()))
            if self._interrupted:
                self._interrupted = False
                if plan.num_steps > 1:
                    self._pub.send(step_pb2.SchedulerMessage(end_run=step_pb2.EndRun(
                        epoch=self.epoch, step_id=plan.step_id)).SerializeToString())
            if time.monotonic() >= next_check:
                self.check_alive()
                next_check = time.monotonic() + poll_seconds
            if message is None:
                continue
            result = self._note(message)
            if result is None:
                continue
            if result.epoch == self.epoch and result.step_id == plan.step_id:
                return result
            self._drop("unexpected_step", step_id=result.step_id, epoch=result.epoch,
                       expected_step_id=plan.step_id, expected_epoch=self.epoch)

    def drain(self) -> None:
        """Reads whatever is queued (registrations repeated as heartbeats) without blocking."""
        while True:
            message = self._receive(0)
            if message is None:
                return
            self._note(message)

    def shutdown_workers(self, reason: str, instance_ids: list[int] | None = None) -> None:
        """Tells the worker processes `instance_ids` to exit; every worker when it is None."""
        message = step_pb2.SchedulerMessage(shutdown=step_pb2.Shutdown(
            reason=reason, instance_ids=instance_ids or []))
        self._pub.send(message.SerializeToString())

    def forget_ranks(self, reason: str = "the scheduler gave up on this replica's ranks") -> None:
        """Tells the processes of the lost replica to exit (by instance id: a rank that replaces
        one of them stays) and waits for fresh registrations."""
        instance_ids = sorted(state.instance_id for state in self.ranks.values())
        now = time.monotonic()
        self.dismissed_instances = {instance: at for instance, at in self.dismissed_instances.items()
                                    if now - at < DISMISSED_SECONDS}
        if instance_ids:
            self.shutdown_workers(reason, instance_ids)
            self.dismissed_instances.update(dict.fromkeys(instance_ids, now))
        self.ranks.clear()

    def close(self) -> None:
        self._pub.close(CLOSE_LINGER_MS)
        self._pull.close(0)
        wake, self._wake_write = self._wake_write, None
        os.close(wake)
        os.close(self._wake_read)
        if self._curve is not None:
            self._curve.stop()
