"""--scheduling-policy priority: queues in (priority, arrival) order, a waiting request preempts
running ones of strictly lower priority (lowest, newest first), equal priorities never preempt
each other, and with every priority equal the plans are those of fcfs, step for step.

Randomized workloads run on the digest worker (scheduler_harness.run_workload), which checks the
block invariants after every step; tokens must equal those of an unpressured run."""

from __future__ import annotations

import dataclasses

from hypothesis import event, given, settings
from hypothesis import strategies as st
from scheduler_harness import RequestSpec, run_workload
from test_scheduler_properties import _HEALTH, _check_against_oracle, _workload

from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import GroupStatus
from pagedserve.contracts.step_plan import StepPlan

_PRIORITIES = st.sampled_from([0, 1, 10, 10])


def _with_priorities(data, config: SchedulerConfig, specs: list[RequestSpec]):
    config = dataclasses.replace(config, scheduling_policy="priority")
    specs = [dataclasses.replace(spec, priority=data.draw(_PRIORITIES)) for spec in specs]
    return config, specs


class QueueObserver:
    """on_step hook: after each schedule(), checks who started and who was preempted against the
    queues as they were before it."""

    def __init__(self) -> None:
        self.previous_running: set[str] = set()
        self.num_victims = 0
        self.num_priority_victims = 0

    def __call__(self, scheduler: Scheduler, plan: StepPlan) -> None:
        running = {group.request_id for group in scheduler.running}
        queued = {group.request_id for group in scheduler.waiting + scheduler.swapped}
        key = lambda request_id: scheduler.group_of(request_id).queue_key  # noqa: E731
        started = running - self.previous_running  # admitted or swapped in by this schedule()
        victims = self.previous_running & queued
        still_queued = queued - victims
        if started and still_queued:
            # admission and swap-in follow (priority, arrival) strictly: nobody passes a queued group
            assert max(map(key, started)) < min(map(key, still_queued))
        for victim in victims:
            # the victim is the worst by (priority, arrival) of everything that runs now
            assert all(key(other) < key(victim) for other in running), (victim, running)
            self.num_victims += 1
            if any(scheduler.group_of(rid).priority < scheduler.group_of(victim).priority for rid in started):
                self.num_priority_victims += 1
        self.previous_running = running



def _observe(config: SchedulerConfig, specs: list[RequestSpec]) -> QueueObserver:
    observer = QueueObserver()

    def on_step(scheduler: Scheduler, plan: StepPlan) -> None:
        observer(scheduler, plan)

    run_workload(config, specs, on_step=on_step)
    return observer


@settings(max_examples=120, deadline=None, suppress_health_check=_HEALTH)
@given(_workload(), st.data())
def test_priority_workloads_match_the_oracle(workload, data) -> None:
    config, specs, reset_steps = workload
    config, specs = _with_priorities(data, config, specs)
    _check_against_oracle(config, specs, reset_steps)


@settings(max_examples=60, deadline=None, suppress_health_check=_HEALTH)
@given(_workload(is_crowded=True), st.data())
def test_crowded_priority_workloads_keep_the_order_and_pick_the_right_victims(workload, data) -> None:
    config, specs, _ = workload
    config, specs = _with_priorities(data, config, specs)
    observer = _observe(config, specs)
    event(f"preempted for a higher priority: {observer.num_priority_victims > 0}")


@settings(max_examples=60, deadline=None, suppress_health_check=_HEALTH)
@given(_workload(is_crowded=True), st.data())
def test_equal_priorities_schedule_exactly_like_fcfs(workload, data) -> None:
    config, specs, reset_steps = workload
    priority = data.draw(_PRIORITIES)
    same = [dataclasses.replace(spec, priority=priority) for spec in specs]
    fcfs = run_workload(config, same, reset_steps=reset_steps)
    by_priority = run_workload(dataclasses.replace(config, scheduling_policy="priority"), same,
                               reset_steps=reset_steps)
    assert by_priority.plans == fcfs.plans
    assert by_priority.scheduler.stats() == fcfs.scheduler.stats()


def _decode_flood_config(**overrides) -> SchedulerConfig:
    values = dict(num_gpu_blocks=64, num_cpu_blocks=64, block_size=4, max_model_len=128, max_num_seqs=2,
                  max_num_batched_tokens=64, scheduling_policy="priority")
    values.update(overrides)
    return SchedulerConfig(**values)


def _long(request_id: str, priority: int, arrival_step: int = 0) -> RequestSpec:
    return RequestSpec(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True),
                       arrival_step=arrival_step, priority=priority)




def _start_steps(config: SchedulerConfig, specs: list[RequestSpec]) -> tuple[dict[str, int], QueueObserver]:
    """The step index at which each request first ran, and the observer's counts."""
    starts: dict[str, int] = {}
    observer = QueueObserver()
    step_index = [0]

    def on_step(scheduler: Scheduler, plan: StepPlan) -> None:
        observer(scheduler, plan)
        for group in scheduler.running:
            starts.setdefault(group.request_id, step_index[0])
        step_index[0] += 1

    run_workload(config, specs, on_step=on_step)
    return starts, observer


def test_a_higher_priority_request_preempts_the_lowest_priority_newest_group() -> None:
    for mode in ("swap", "recompute"):
        specs = [_long("low-old", 10), _long("low-new", 10), _long("urgent", 0, arrival_step=3)]
        starts, observer = _start_steps(_decode_flood_config(preemption_mode=mode), specs)
        assert starts["urgent"] <= 4, starts  # admitted within a step of arriving, both slots taken
        assert observer.num_priority_victims == 1


def test_equal_or_lower_priorities_wait_and_never_preempt() -> None:
    for priority in (10, 20):
        specs = [_long("a", 10), _long("b", 10), _long("late", priority, arrival_step=3)]
        starts, observer = _start_steps(_decode_flood_config(), specs)
        assert observer.num_victims == 0
        assert starts["late"] > 25, starts  # waits for a slot: a and b decode 30 tokens each


def test_a_preempted_request_keeps_its_place_among_its_priority() -> None:
    specs = [_long("low-old", 10), _long("low-new", 10), _long("urgent", 0, arrival_step=3),
             _long("low-later", 10, arrival_step=4)]
    starts, _ = _start_steps(_decode_flood_config(preemption_mode="recompute"), specs)
    assert starts["low-new"] < starts["low-later"]  # low-new was preempted, yet comes back first


def test_fcfs_ignores_priority() -> None:
    specs = [_long("a", 10), _long("b", 10), _long("urgent", 0, arrival_step=3)]
    starts, observer = _start_steps(_decode_flood_config(scheduling_policy="fcfs"), specs)
    assert observer.num_victims == 0
    assert starts["urgent"] > 25
