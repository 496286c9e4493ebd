"""The worker process: subscribes to step plans, runs them on its model shard, answers (rank 0).

    SUB  <- SchedulerMessage: InitCache (allocate KV blocks for an epoch), StepPlan,
                              Shutdown (for this process's instance id, or for every worker)
    PUSH -> WorkerMessage:    Register (every second from a thread, for as long as it lives: the
                              heartbeat), Ready, StepResult (rank 0 only),
                              WorkerError (then the process exits)

Step plans are numbered within an epoch; a worker that sees a gap stops and says so, since its KV
cache would no longer match the scheduler's block tables. A worker outlives its scheduler: the
sockets reconnect when a restarted scheduler binds the same addresses, the new scheduler learns
the rank from its repeated registration, and its InitCache starts a new epoch (the KV tensors are
kept when the pool size is unchanged: the new block tables start empty).

Tensor parallelism: the ranks of one replica form a torch.distributed process group (NCCL on CUDA,
gloo on CPU) at --dist-init-address (rank 0 listens on its host only: rendezvous.py), with
--dist-timeout bounding every collective. Every rank executes every plan on its shard; rank 0
alone samples and answers. A rank whose collective fails (a peer died: gloo sees the connection
close at once; a peer stalled: the timeout) reports a WorkerError and exits 1, since the group
cannot be repaired; SIGTERM/SIGINT make a rank report "stopped" and exit 0. Either way the scheduler marks the replica unready at once.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from functools import partial

import zmq

from pagedserve.security.zmq_curve import (
    CurveKeys, check_internal_transport, curve_keys_from_env, require_client_secret, secure_client,
)
from pagedserve.internal import step_pb2
from pagedserve.log import configure_logging
from pagedserve.contracts.plan_codec import encode_result, plan_from_proto
from pagedserve.contracts.step_plan import StepPlan, StepResult
from pagedserve.worker.continuation import is_same_step, next_plan, run_steps
from pagedserve.worker import resident_memory
from pagedserve.worker.cpu_share import CpuShare
from pagedserve.worker.memory_budget import exceeds_available, plan_memory
from pagedserve.worker.message_poll import NativePoll
from pagedserve.worker.rendezvous import init_process_group
from pagedserve.worker.layers.tensor_parallel import CollectiveError
from pagedserve.worker.config import WorkerConfig

HEARTBEAT_SECONDS = 1.0


def new_instance_id() -> int:
    """This process's identity towards the scheduler: random, 64 bits, never 0 (an unset field).
    Not the pid, which repeats across containers (scheduler/worker_link.py)."""
    return secrets.randbits(64) or 1


class StepGap(RuntimeError):
    pass


class WorkerStopped(Exception):
    """Raised in the main thread by SIGTERM or SIGINT."""


class _Pusher:
    """A PUSH socket shared by the step loop and the heartbeat thread."""

    def __init__(self, context: zmq.Context, address: str, curve: CurveKeys | None = None) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 2000)
        if curve is not None:
            secure_client(self._socket, curve)
        self._socket.connect(address)
        self._lock = threading.Lock()

    def send(self, message: step_pb2.WorkerMessage | bytes) -> None:
        payload = message if isinstance(message, bytes) else message.SerializeToString()
        with self._lock:
            self._socket.send(payload)

    def close(self) -> None:
        self._socket.close()


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def init_distributed(config: WorkerConfig, device: str):
    """Joins the replica's process group (rendezvous.py: rank 0 listens on the address's host
    only); returns what must stay referenced while it lives (rank 0's listening socket)."""
    import torch

    if config.world_size == 1:
        return None
    if device.startswith("cuda"):
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    backend = "nccl" if device.startswith("cuda") else "gloo"
    return init_process_group(config.dist_init_address, config.rank, config.world_size,
                              config.dist_timeout_s, backend)


def _raise_stopped(signum, frame) -> None:
    raise WorkerStopped(f"stopped by {signal.Signals(signum).name}")


def run_worker(config: WorkerConfig, *, adapts_threads: bool = False) -> int:
    """Runs until Shutdown or a signal; returns the process exit code. adapts_threads: the thread
    count follows the host's load (worker/cpu_share.py)."""
    import torch

    from pagedserve.worker.model_runner import ModelRunner

    log = configure_logging("worker").bind(rank=config.rank)
    curve = curve_keys_from_env()  # the scheduler's CURVE link (pagedserve.security.zmq_curve), when set
    require_client_secret(curve)  # before the model loads: a missing key fails in a second, not a load
    instance_id = new_instance_id()
    if check_internal_transport((config.plan_address, config.result_address), curve,
                                is_insecure_allowed=config.allow_insecure_internal_transport):
        log.warning("internal_zmq_unauthenticated", plan_address=config.plan_address,
                    result_address=config.result_address)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    cpu_share = (CpuShare(torch.get_num_threads(), initial_threads=1)
                 if adapts_threads and device == "cpu" and torch.get_num_threads() > 1 else None)
    if cpu_share is not None:
        torch.set_num_threads(1)  # while the model loads beside the frontend and the scheduler (cpu_share.py)
    if device.startswith("cuda") and config.world_size > 1:
        device = f"cuda:{config.rank % max(1, torch.cuda.device_count())}"
    rendezvous = init_distributed(config, device)  # noqa: F841 (rank 0's listener lives with the group)
    runner = ModelRunner(config.model_path, device=device, dtype=config.dtype,
                         block_size=config.block_size, rank=config.rank,
                         world_size=config.world_size, quantization=config.quantization,
                         quantization_group_size=config.quantization_group_size,
                         kv_cache_dtype=config.kv_cache_dtype, speculative_model=config.speculative_model,
                         speculative_quantization=config.speculative_quantization,
                         lora=config.lora_config)
    started = time.monotonic()
    with resident_memory.growth() as grown:
        runner.load()
    log.info("model_loaded", device=device, world_size=config.world_size,
             seconds=round(time.monotonic() - started, 2),
             num_weight_bytes=runner.num_weight_bytes, quantization=config.quantization,
             kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
             num_checkpoint_bytes_read=runner.num_checkpoint_bytes_read,
             num_rss_bytes=resident_memory.status_bytes("VmRSS")["VmRSS"], **grown)
    if runner.draft is not None:
        log.info("draft_model_loaded", speculative_model=config.speculative_model,
                 speculative_quantization=config.speculative_quantization,
                 num_weight_bytes=runner.num_draft_weight_bytes, num_layers=len(runner.draft.model.layers))
    budget = plan_memory(runner, device_type="cuda" if device.startswith("cuda") else "cpu",
                         num_ranks=config.world_size, kv_cache_memory_gib=config.kv_cache_memory_gib,
                         swap_space_gib=config.swap_space_gib, host_tier_gib=config.host_tier_gib)
    log.info("memory_budget", **budget.log_fields())
    if exceeds_available(budget):
        log.warning("memory_budget_exceeds_available", reason="other processes use the host's memory; "
                    "the KV pool or swap space may be paged out or killed for lack of memory")
    capacity, num_cpu_blocks = budget.num_gpu_blocks, budget.num_cpu_blocks
    layout = runner.kv_layout() if budget.num_host_blocks or config.kv_cache_dir else None
    if layout is not None:
        log.info("kv_tiers", num_host_blocks=budget.num_host_blocks, kv_cache_dir=config.kv_cache_dir,
                 kv_layout_id=layout.layout_id)

    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        secure_client(sub, curve)
    sub.connect(config.plan_address)
    pusher = _Pusher(context, config.result_address, curve)
    state = {"epoch": 0, "instance_id": instance_id}
    stop = threading.Event()
    register = step_pb2.WorkerMessage(register=step_pb2.Register(
        rank=config.rank, world_size=config.world_size, num_gpu_blocks=capacity,
        num_cpu_blocks=num_cpu_blocks, device=device, pid=os.getpid(), instance_id=instance_id,
        num_host_blocks=budget.num_host_blocks,
        kv_layout_id=layout.layout_id if layout is not None and config.kv_cache_dir else "",
        num_bytes_per_block=runner.bytes_per_block)).SerializeToString()

    def heartbeat() -> None:
        """Registers every second: the scheduler may start later, miss the first, or restart;
        to one that knows this rank the registration is its heartbeat."""
        while not stop.wait(HEARTBEAT_SECONDS):
            pusher.send(register)

    pusher.send(register)
    threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, _raise_stopped)
    try:
        return _serve_plans(config, runner, sub, pusher, state, log, cpu_share, layout)
    except WorkerStopped as exc:
        log.info("worker_stopping", reason=str(exc))
        pusher.send(step_pb2.WorkerMessage(error=step_pb2.WorkerError(
            rank=config.rank, message=str(exc), pid=os.getpid(), instance_id=instance_id)))
        return 0
    except CollectiveError as exc:
        log.error("tensor_parallel_group_broken", error=str(exc))
        pusher.send(step_pb2.WorkerMessage(error=step_pb2.WorkerError(
            rank=config.rank, pid=os.getpid(), instance_id=instance_id,
            message=f"its tensor-parallel group broke (another rank died or stalled): {exc}")))
        return 1
    except Exception as exc:  # reported to the scheduler, then the process exits non-zero
        log.exception("worker_failed")
        pusher.send(step_pb2.WorkerMessage(error=step_pb2.WorkerError(
            rank=config.rank, message=f"{type(exc).__name__}: {exc}", pid=os.getpid(), instance_id=instance_id)))
        return 1
    finally:  # bounded (the socket linger): a second signal must not cut it short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        if runner.tiers is not None and runner.tiers.writer is not None:
            runner.tiers.writer.flush(timeout=10.0)  # block files queued so far reach the disk
        time.sleep(0.05)
        pusher.close()
        sub.close(0)


def _serve_plans(config, runner, sub, pusher, state, log, cpu_share=None, layout=None) -> int:
    import torch

    last_step_id: int | None = None  # the first plan of an epoch sets the base
    message = step_pb2.SchedulerMessage()
    computes_ahead = config.world_size == 1  # other ranks would not know the sampled tokens
    ahead: tuple[StepPlan, StepResult] | None = None  # the likely next step, computed (continuation.py)

    poller = zmq.Poller()  # kept: Socket.poll builds and registers a Poller per call
    poller.register(sub, zmq.POLLIN)

    def has_message() -> bool:
        return bool(poller.poll(0))

    def dropping_failures(call: Callable, event: str) -> Callable:
        """call for a step no plan asked for yet (one computed ahead, a later step of a decode run):
        what fails is dropped (None) and logged at debug as `event`; the plan itself, when it comes,
        runs again and reports it."""
        def guarded(*args):
            try:
                return call(*args)
            except WorkerStopped:
                raise
            except Exception:
                log.debug(event, exc_info=True)
                return None
        return guarded

    try_execute = dropping_failures(runner.execute, "step_ahead_failed")

    native_poll = NativePoll.for_socket(sub)  # has_message as a C call, for a run's steps in one native call

    def steps_after(result: StepResult) -> Callable | None:
        """The decode run's later steps straight through the runner (ModelRunner.steps_after), all in
        one native call where it can (`many`) and the message check can be made from C."""
        advance = runner.steps_after(result)
        if advance is None:
            return None
        guarded = dropping_failures(advance, "step_in_run_failed")
        guarded.many = (dropping_failures(partial(advance.many, poll=native_poll.args), "step_in_run_failed")
                        if advance.many is not None and native_poll is not None else None)
        return guarded

    while True:
        message.ParseFromString(sub.recv())
        kind = message.WhichOneof("kind")
        if kind == "end_run":
            continue  # came after its run ended: moot (continuation.py)
        computed_ahead, ahead = ahead, None
        if kind == "shutdown":
            if message.shutdown.instance_ids and state["instance_id"] not in message.shutdown.instance_ids:
                continue  # meant for the processes this one replaces
            log.info("shutdown", reason=message.shutdown.reason)
            return 0
        if kind == "init_cache":
            init = message.init_cache
            if init.epoch != state["epoch"]:
                sizes = (init.num_gpu_blocks, init.num_cpu_blocks, init.num_host_blocks)
                num_host = runner.tiers.num_host_blocks if runner.tiers is not None else 0
                if runner.cache is None or (runner.cache.num_gpu_blocks, runner.cache.num_cpu_blocks, num_host) != sizes:
                    runner.release_cache()  # the old pool goes before the new one is allocated
                    runner.init_cache(*sizes, kv_cache_dir=config.kv_cache_dir, layout=layout)
                state["epoch"] = init.epoch
                last_step_id = None
                if cpu_share is not None and (num_threads := cpu_share.ready()) is not None:
                    torch.set_num_threads(num_threads)  # from the first request on (cpu_share.py)
                log.info("kv_cache_ready", epoch=init.epoch, num_gpu_blocks=init.num_gpu_blocks,
                         num_cpu_blocks=init.num_cpu_blocks, num_threads=torch.get_num_threads())
            pusher.send(step_pb2.WorkerMessage(ready=step_pb2.Ready(rank=config.rank,
                                                                    epoch=init.epoch)))
            continue
        if kind == "step_masks":
            continue  # ranks that do not sample skip them (rank 0 reads them in receive_masks)
        plan_msg = message.step_plan
        if plan_msg.epoch != state["epoch"]:
            continue
        if last_step_id is not None and plan_msg.step_id != last_step_id + 1:
            raise StepGap(f"expected step {last_step_id + 1} of epoch {state['epoch']}, "
                          f"got {plan_msg.step_id}: plans were lost")
        last_step_id = plan_msg.step_id
        receive_masks = None
        if plan_msg.masks_follow and config.rank == 0:
            receive_masks = partial(_receive_masks, sub, plan_msg.epoch, plan_msg.step_id)
        plan = plan_from_proto(plan_msg)
        if computed_ahead is not None and is_same_step(computed_ahead[0], plan):
            result = computed_ahead[1]
        else:
            result = runner.execute(plan, receive_masks)  # carries the plan's step id and epoch
        last, last_result = plan, result
        if computes_ahead and plan.num_steps > 1:  # a decode run: its later steps now (continuation.py)
            with torch.inference_mode():  # once for the run, not per step (ModelRunner._execute_in_run)
                result, last, last_result = run_steps(result, plan, runner.block_size, try_execute, has_message,
                                                      lambda step: pusher.send(encode_result(step)), steps_after)
        if config.rank == 0:
            pusher.send(encode_result(result))
        if (computes_ahead and not has_message()  # a plan that is here already needs no guess
                and (following := next_plan(last, last_result, runner.block_size)) is not None):
            following.step_id = plan.step_id + 1
            if (result_ahead := try_execute(following)) is not None:
                ahead = following, result_ahead
        if cpu_share is not None and (num_threads := cpu_share.after_step()) is not None:
            torch.set_num_threads(num_threads)
            log.info("cpu_threads_changed", num_threads=num_threads, other_cores=round(cpu_share.other_cores, 2))


class MasksLost(RuntimeError):
    """The scheduler stopped before the bitmask rows of a step arrived."""


def _receive_masks(sub, epoch: int, step_id: int) -> bytes:
    """The token bitmask rows of the step (its StepMasks follows the plan on the same socket)."""
    message = step_pb2.SchedulerMessage()
    while True:
        message.ParseFromString(sub.recv())
        kind = message.WhichOneof("kind")
        if kind == "step_masks" and (message.step_masks.epoch, message.step_masks.step_id) == (epoch, step_id):
            return message.step_masks.token_bitmasks
        if kind in ("shutdown", "init_cache", "step_plan"):
            raise MasksLost(f"expected the masks of step {step_id}, got a {kind} message")
