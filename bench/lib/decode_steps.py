"""Decode steps in-process, shared by the step benchmarks (overheads, step_profile, forward_ab,
compile_forward): a scheduler whose requests are already prefilled, a stand-in greedy result, the
serving loop of one step timed by part, and a process's CPU seconds.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from pagedserve.contracts.plan_codec import encode_plan, encode_result, plan_from_proto, result_from_proto
from pagedserve.contracts.request_types import Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.contracts.step_plan import SeqSample, StepResult
from pagedserve.internal import step_pb2
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.scheduler import Scheduler

PROMPT_LEN = 64


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def decode_scheduler(num_seqs: int, *, block_size: int = 16, max_tokens: int = 2000) -> Scheduler:
    """A scheduler with num_seqs greedy requests whose prompts are already computed (room for
    about 60 decode steps each)."""
    config = SchedulerConfig(num_gpu_blocks=num_seqs * 10 + 256, max_model_len=max_tokens + PROMPT_LEN,
                             block_size=block_size, max_num_seqs=num_seqs,
                             max_num_batched_tokens=max(2048, num_seqs))
    scheduler = Scheduler(config)
    for index in range(num_seqs):
        prompt = [(index * 7 + offset) % 500 + 4 for offset in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"r{index}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      eos_token_ids=[2]))
    while scheduler.waiting or any(seq.num_computed_tokens < len(seq.token_ids) - 1
                                   for group in scheduler.running for seq in group.seqs):
        step = scheduler.schedule()
        scheduler.process_result(step, fake_result(step.plan))
    return scheduler


def fake_result(plan) -> StepResult:
    """One token per sampling sequence, as a greedy worker answers."""
    return StepResult(step_id=plan.step_id, epoch=plan.epoch,
                      samples=[SeqSample(seq.seq_id, (seq.seq_id * 31 + len(seq.token_ids)) % 500 + 4, -0.5)
                               for seq in plan.seqs if seq.sample is not None])


class PartTimer:
    """Wraps callables so that each call's seconds accumulate under a name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
        return timed


def serving_step_row(num_seqs: int, num_steps: int, model_path: Path, *, dtype: str = "float32") -> dict:
    """The in-process serving loop at num_seqs decodes; medians per part over num_steps steps."""
    from pagedserve.worker import model_runner as runner_module
    from pagedserve.worker.model_runner import ModelRunner

    runner = ModelRunner(model_path, device="cpu", dtype=dtype, block_size=16)
    runner.load()
    scheduler = decode_scheduler(num_seqs)
    runner.init_cache(scheduler.config.num_gpu_blocks, 0)
    timer = PartTimer()
    build_input = runner_module.build_model_input
    runner_module.build_model_input = timer.wrap("build_inputs", build_input)
    runner.sampler.sample = timer.wrap("sample", runner.sampler.sample)
    parts: dict[str, list[float]] = {}
    try:
        for index in range(num_steps + 3):
            timer.seconds.clear()
            marks = [time.perf_counter()]
            step = scheduler.schedule()
            marks.append(time.perf_counter())
            payload = encode_plan(step.plan)
            message = step_pb2.SchedulerMessage()
            message.ParseFromString(payload)
            plan = plan_from_proto(message.step_plan)
            marks.append(time.perf_counter())
            result = runner.execute(plan)
            marks.append(time.perf_counter())
            result_message = step_pb2.WorkerMessage()
            result_message.ParseFromString(encode_result(result))
            result = result_from_proto(result_message.step_result)
            marks.append(time.perf_counter())
            scheduler.process_result(step, result)
            marks.append(time.perf_counter())
            if index < 3:  # warm-up
                continue
            execute = marks[3] - marks[2]
            sample = timer.seconds.get("sample", 0.0)
            build = timer.seconds.get("build_inputs", 0.0)
            values = {"schedule": marks[1] - marks[0], "plan_codec": marks[2] - marks[1],
                      "build_inputs": build, "forward": result.forward_seconds, "sample": sample,
                      "execute_other": execute - build - result.forward_seconds - sample,
                      "result_codec": marks[4] - marks[3], "process_result": marks[5] - marks[4],
                      "step": marks[5] - marks[0]}
            values["outside_forward"] = values["step"] - values["forward"]
            for name, seconds in values.items():
                parts.setdefault(name, []).append(seconds)
    finally:
        runner_module.build_model_input = build_input
    return {"num_seqs": num_seqs, **{f"{name}_ms": median_ms(samples) for name, samples in parts.items()}}


def run_step_row(num_seqs: int, num_steps: int, model_path: Path, *, dtype: str = "float32") -> dict:
    """The later steps of a decode run in-process, as the worker computes them (worker/continuation.py
    next_plan, then ModelRunner.execute through its kept decode run): per step, the time outside the
    forward (the plan derived, the rows written, the greedy kernel and its lists, the result), in
    microseconds, medians over num_steps steps. Each step follows a forward whose weights went
    through the CPU caches, as in serving; the forward's own time comes from its result."""
    from pagedserve.worker.continuation import next_plan
    from pagedserve.worker.model_runner import ModelRunner

    runner = ModelRunner(model_path, device="cpu", dtype=dtype, block_size=16)
    runner.load()
    scheduler = decode_scheduler(num_seqs)
    runner.init_cache(scheduler.config.num_gpu_blocks, 0)
    message = step_pb2.SchedulerMessage()
    message.ParseFromString(encode_plan(scheduler.schedule().plan))
    first = plan_from_proto(message.step_plan)
    outside, forward = [], []
    while len(outside) < num_steps + 3:
        plan, result = first, runner.execute(first)  # back to the first step where the blocks end
        before = len(outside)
        while len(outside) < num_steps + 3:
            started = time.perf_counter()
            following = next_plan(plan, result, runner.block_size, in_run=True)
            if following is None:
                break
            result = runner.execute(following)
            outside.append(time.perf_counter() - started - result.forward_seconds)
            forward.append(result.forward_seconds)
            plan = following
        if len(outside) == before:
            raise RuntimeError("the first plan has no later step (not a decode run of plain greedy decodes)")
    return {"num_seqs": num_seqs, "run_step_outside_us": statistics.median(outside[3:]) * 1e6,
            "run_step_forward_ms": median_ms(forward[3:]), "in_decode_run": runner._decode_run is not None}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
