"""The step loop (scheduler/engine.py) against a link whose worker is the KV-simulating fake: what
reaches each request's sink, in what order, and when the outputs of a step are handed over."""

from __future__ import annotations

import threading
import time

from pagedserve.contracts.request_types import Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.engine import Engine, EngineUnavailable
from pagedserve.scheduler.core.errors import RequestFailed, RequestRejected
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.worker_link import PoolSize, WorkerLost
from pagedserve.contracts.step_plan import SeqFailure
from tests.scheduler.scheduler_harness import EOS_TOKEN_ID, digest_worker

NUM_BLOCKS = 64
BLOCK_SIZE = 4


class FakeLink:
    """The WorkerLink surface the engine uses, with one in-process fake worker; records every
    publish and dispatch in one event list so their order can be checked."""

    def __init__(self, events: list, fail_at_step: int | None = None) -> None:
        self.epoch = 0
        self.world_size = 1
        self.events = events
        self.fail_at_step = fail_at_step
        self.worker = digest_worker(SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0,
                                                 block_size=BLOCK_SIZE, max_model_len=256))
        self._pending = None

    def all_registered(self) -> bool:
        return True

    def poll_registration(self, timeout: float) -> None:
        pass

    def init_cache(self, max_gpu_blocks, deadline) -> PoolSize:
        self.epoch += 1
        return PoolSize(NUM_BLOCKS, 0)

    def interrupt(self) -> None:
        self.events.append(("interrupt",))

    def publish(self, plan) -> None:
        plan.epoch = self.epoch
        self.events.append(("publish", plan.step_id))
        self._pending = plan

    def wait_result(self, plan, poll_seconds: float = 0.5):
        assert self._pending is plan
        if self.fail_at_step is not None and plan.step_id >= self.fail_at_step:
            raise WorkerLost("rank 0 is gone")
        return self.worker.run(plan)

    def drain(self) -> None:
        pass

    def check_alive(self) -> None:
        pass

    def shutdown_workers(self, reason: str) -> None:
        pass

    def forget_ranks(self, reason: str = "") -> None:
        pass


def _engine(events: list, fail_at_step: int | None = None) -> Engine:
    def dispatch(pairs) -> None:
        events.append(("dispatch", len(pairs)))
        for sink, item in pairs:
            sink(item)

    config = SchedulerConfig(block_size=BLOCK_SIZE, max_model_len=256, max_num_seqs=8, num_gpu_blocks=NUM_BLOCKS)
    engine = Engine(config, FakeLink(events, fail_at_step), dispatch=dispatch)
    engine.start()
    deadline = time.monotonic() + 5
    while not engine.state.is_ready:
        assert time.monotonic() < deadline, "the engine did not become ready"
        time.sleep(0.01)
    return engine


class Collector:
    def __init__(self) -> None:
        self.items: list = []
        self.done = threading.Event()

    def __call__(self, item) -> None:
        self.items.append(item)
        if isinstance(item, Exception) or item.is_finished:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [token for item in self.items if not isinstance(item, Exception)
                for delta in item.deltas for token in delta.token_ids]


def _request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    prompt = [(index * 5 + len(request_id)) % 20 + 1 for index in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_ids=[EOS_TOKEN_ID])


def test_outputs_of_a_step_go_out_in_one_batch_after_the_next_plan():
    events: list = []
    engine = _engine(events)
    try:
        collectors = {}
        # Submitted from the loop thread's own queue in one go, so they are scheduled together.
        gate = threading.Event()
        engine._commands.post(gate.wait)
        for index in range(3):
            collectors[f"r{index}"] = Collector()
            engine.submit(_request(f"r{index}", 6 + index, 5), collectors[f"r{index}"])
        gate.set()
        for collector in collectors.values():
            assert collector.done.wait(5)
    finally:
        engine.stop()
    for collector in collectors.values():
        assert len(collector.tokens) == 5
        assert collector.items[-1].is_finished
    steps = [event for event in events if event[0] == "publish"]
    dispatches = [event for event in events if event[0] == "dispatch"]
    assert len(steps) == 5  # one prefill step, then four decode steps, all three together
    assert all(size == 3 for _, size in dispatches), dispatches
    # Step N's outputs are handed over right after plan N + 1 is published; the last step's
    # outputs once nothing is left to schedule.
    kinds = [kind for kind, _ in events]
    assert kinds == ["publish"] + ["publish", "dispatch"] * 4 + ["dispatch"]


def _run_alone(request: Request, fail_at_step: int | None = None) -> tuple[Collector, list]:
    """Runs one request on a fresh engine until its sink has the last item; (sink, events)."""
    events: list = []
    engine = _engine(events, fail_at_step)
    try:
        collector = Collector()
        engine.submit(request, collector)
        assert collector.done.wait(5)
    finally:
        engine.stop()
    return collector, events


def test_tokens_of_steps_before_a_failure_arrive_before_it():
    collector, _ = _run_alone(_request("r0", 6, 10), fail_at_step=3)
    *tokens, failure = collector.items
    assert isinstance(failure, EngineUnavailable)
    # Steps are numbered from 1: the tokens of steps 1 and 2, then step 3 fails (step 2's token
    # goes out after step 3's plan is published, before its result is awaited).
    assert [item.deltas[0].token_ids for item in tokens] == [[token] for token in collector.tokens]
    assert len(tokens) == 2


def test_rejected_request_gets_its_error_through_dispatch():
    collector, events = _run_alone(_request("too-long", 300, 5))
    (error,) = collector.items
    assert isinstance(error, RequestRejected), error
    assert ("dispatch", 1) in events


class PoisonLink(FakeLink):
    """A worker whose sampling fails for one request's sequences (poison_sampling), or that
    crashes whenever a plan holds the poison request (poison_crash); the engine recovers."""

    def __init__(self, events: list, poison_id: str, mode: str) -> None:
        super().__init__(events)
        self.poison_id = poison_id
        self.mode = mode
        self.poison_seq_ids: set[int] = set()
        self.num_crashes = 0

    def wait_result(self, plan, poll_seconds: float = 0.5):
        is_poisoned = any(seq.seq_id in self.poison_seq_ids for seq in plan.seqs)
        if self.mode == "crash" and is_poisoned:
            self.num_crashes += 1
            self.worker = digest_worker(SchedulerConfig(num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=0,
                                                        block_size=BLOCK_SIZE, max_model_len=256))
            raise WorkerLost("rank 0 died computing the poison request")
        result = super().wait_result(plan, poll_seconds)
        if self.mode == "sampling" and is_poisoned:
            failed = {sample.seq_id for sample in result.samples} & self.poison_seq_ids
            result.samples = [sample for sample in result.samples if sample.seq_id not in failed]
            result.failures = [SeqFailure(seq_id, "sampling failed: boom") for seq_id in sorted(failed)]
        return result


def _run_with_poison(mode: str) -> tuple[dict[str, Collector], PoisonLink, dict[str, list[int]]]:
    """Three innocent requests and a poison one, submitted together; returns the sinks, the link
    and the innocent requests' tokens from an undisturbed run."""
    undisturbed = {f"ok{i}": _run_alone(_request(f"ok{i}", 5 + i, 8))[0].tokens for i in range(3)}
    events: list = []
    config = SchedulerConfig(block_size=BLOCK_SIZE, max_model_len=256, max_num_seqs=8, num_gpu_blocks=NUM_BLOCKS,
                             worker_recovery_timeout=10.0)
    link = PoisonLink(events, "poison", mode)
    engine = Engine(config, link)
    engine.start()
    try:
        while not engine.state.is_ready:
            time.sleep(0.01)
        collectors = {name: Collector() for name in [*undisturbed, "poison"]}
        gate = threading.Event()
        engine._commands.post(gate.wait)
        for name, collector in collectors.items():
            engine.submit(_request(name, 7 if name == "poison" else 5 + int(name[-1]), 8), collector)
        # the poison request's sequence ids, as the scheduler numbers them (on the loop thread)
        engine._commands.post(lambda: link.poison_seq_ids.update(
            seq.seq_id for seq in engine.scheduler.group_of("poison").seqs))
        gate.set()
        for collector in collectors.values():
            assert collector.done.wait(10)
        stats = engine.call(lambda: engine.scheduler.stats())
        engine.call(lambda: engine.scheduler.check_invariants())
    finally:
        engine.stop()
    assert stats.gpu.num_used == 0 and stats.num_running == stats.num_waiting == 0
    return collectors, link, undisturbed


def test_a_request_whose_sampling_fails_fails_alone():
    collectors, link, undisturbed = _run_with_poison("sampling")
    (failure,) = [item for item in collectors["poison"].items if isinstance(item, Exception)]
    assert isinstance(failure, RequestFailed) and "boom" in str(failure)
    for name, tokens in undisturbed.items():
        assert collectors[name].tokens == tokens, name
        assert not any(isinstance(item, Exception) for item in collectors[name].items)
    assert link.epoch == 1, "a sampling failure is not a worker loss"


def test_a_request_that_crashes_the_workers_twice_is_failed_not_replayed():
    collectors, link, undisturbed = _run_with_poison("crash")
    failure = collectors["poison"].items[-1]
    assert isinstance(failure, RequestFailed) and "2 consecutive worker crashes" in str(failure)
    assert link.num_crashes == 2
    for name, tokens in undisturbed.items():
        assert collectors[name].tokens == tokens, name


def test_idle_reports_follow_an_abort_without_another_step():
    """The gauges' source: once a request is aborted and nothing else runs, on_idle reports a
    scheduler with nothing running and no block used, although no step follows the abort."""
    reports: list[tuple[int, int]] = []

    def on_idle(engine: Engine) -> None:
        stats = engine.scheduler.stats()
        reports.append((stats.num_running, stats.gpu.num_used))

    config = SchedulerConfig(block_size=BLOCK_SIZE, max_model_len=256, max_num_seqs=8, num_gpu_blocks=NUM_BLOCKS)
    engine = Engine(config, FakeLink([]), on_idle=on_idle)
    engine.start()
    try:
        collector = Collector()
        engine.submit(_request("long", 6, 200), collector)
        deadline = time.monotonic() + 5
        while len(collector.tokens) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.abort("long")
        engine.call(lambda: None)  # the abort has been applied
        applied = len(reports)
        deadline = time.monotonic() + 1.0
        while not reports[applied:] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reports[applied:] and reports[-1] == (0, 0), reports[-3:]
    finally:
        engine.stop()


class GatedLink(FakeLink):
    """A FakeLink whose decode runs wait for `gate` before their result (a run in flight)."""

    def __init__(self, events: list) -> None:
        super().__init__(events)
        self.gate = threading.Event()
        self.in_run = threading.Event()

    def wait_result(self, plan, poll_seconds: float = 0.5):
        if plan.num_steps > 1:
            self.in_run.set()
            assert self.gate.wait(5), "the test did not open the gate"
        return super().wait_result(plan, poll_seconds)


def test_a_read_of_the_state_waits_for_a_decode_run_and_does_not_end_it():
    """Engine.call (GetStats) runs after the run in flight, without interrupting it (a request that
    arrives or leaves does: worker_link.py EndRun)."""
    events: list = []
    link = GatedLink(events)
    config = SchedulerConfig(block_size=BLOCK_SIZE, max_model_len=256, max_num_seqs=8, num_gpu_blocks=NUM_BLOCKS)
    engine = Engine(config, link)
    engine.start()
    try:
        request = _request("a", prompt_len=5, max_tokens=30)
        request.hold_output = True
        engine.submit(request, Collector())
        assert link.in_run.wait(5), "no decode run was planned"
        answers: list = []
        reader = threading.Thread(target=lambda: answers.append(engine.call(lambda: "read")))
        reader.start()
        time.sleep(0.2)
        assert ("interrupt",) not in events and not answers  # the read waits for the run
        link.gate.set()
        reader.join(5)
        assert answers == ["read"] and ("interrupt",) not in events
    finally:
        link.gate.set()
        engine.stop()
