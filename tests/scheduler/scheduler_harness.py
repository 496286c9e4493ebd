"""A driver that runs a Scheduler against the digest worker (pagedserve/testing/digest_worker.py), which
simulates the KV cache slot by slot and checks every plan. No torch, no processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.testing.digest_worker import DigestWorker
from pagedserve.contracts.request_types import AdapterRef, FinishReason, Request, RequestOutput
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.contracts.step_plan import StepPlan

VOCAB_SIZE = 24
EOS_TOKEN_ID = 0


def digest_worker(config: SchedulerConfig, vocab_size: int = VOCAB_SIZE) -> DigestWorker:
    """A digest worker with this config's pools and the tests' small vocabulary."""
    return DigestWorker.for_config(config, vocab_size=vocab_size)


@dataclass
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_step: int = 0
    abort_step: int | None = None  # abort before this step's schedule()
    finish_step: int | None = None  # finish_completion(finish_index) before this step
    finish_index: int = 0
    priority: int = 0  # lower first under scheduling_policy="priority"
    adapter: AdapterRef | None = None  # a LoRA adapter (None: the base model)
    hold_output: bool = False  # the whole answer at the end (decode runs of up to 32 sequences)

    def request(self) -> Request:
        return Request(request_id=self.request_id, prompt_token_ids=list(self.prompt_token_ids),
                       sampling=self.sampling, eos_token_ids=[EOS_TOKEN_ID], priority=self.priority,
                       adapter=self.adapter, hold_output=self.hold_output)


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    num_logprobs: int = 0


@dataclass
class RequestRecord:
    completions: dict[int, Completion] = field(default_factory=dict)
    is_finished: bool = False
    cached_prompt_tokens: int = 0
    was_aborted: bool = False
    finished_indices: set[int] = field(default_factory=set)  # ended by finish_completion


@dataclass
class RunResult:
    records: dict[str, RequestRecord]
    plans: list[StepPlan]
    scheduler: Scheduler


def collect(records: dict[str, RequestRecord], outputs: list[RequestOutput]) -> None:
    for output in outputs:
        record = records[output.request_id]
        if record.is_finished:
            raise AssertionError(f"output for {output.request_id} after it finished")
        record.cached_prompt_tokens = output.cached_prompt_tokens
        for delta in output.deltas:
            completion = record.completions.setdefault(delta.index, Completion())
            if completion.finish_reason is not None:
                raise AssertionError(f"{output.request_id}[{delta.index}] got a delta after finishing")
            completion.token_ids.extend(delta.token_ids)
            completion.num_logprobs += len(delta.logprobs)
            completion.cumulative_logprob = delta.cumulative_logprob
            completion.finish_reason = delta.finish_reason
        record.is_finished = output.is_finished


def run_workload(config: SchedulerConfig, specs: list[RequestSpec], *, max_steps: int = 5000,
                 on_step: Callable[[Scheduler, StepPlan], None] | None = None,
                 reset_steps: frozenset[int] = frozenset(), vocab_size: int = VOCAB_SIZE,
                 grammars=None) -> RunResult:
    """Drives a scheduler until every request ended; checks invariants after every step.

    At each of reset_steps the workers "restart": scheduler.reset() and a fresh fake KV cache.
    vocab_size: the worker's (a small one makes speculative proposals often right).
    grammars: the scheduler's GrammarCompiler for constrained requests.
    """
    scheduler = Scheduler(config, grammars=grammars)
    worker = digest_worker(config, vocab_size)
    records = {spec.request_id: RequestRecord() for spec in specs}
    plans: list[StepPlan] = []
    step_index = 0
    last_arrival = max((spec.arrival_step for spec in specs), default=0)
    while True:
        for spec in specs:
            if spec.arrival_step == step_index:
                scheduler.add_request(spec.request())
            if spec.abort_step == step_index and scheduler.abort_request(spec.request_id):
                records[spec.request_id].was_aborted = True
            if spec.finish_step == step_index and scheduler.finish_completion(spec.request_id, spec.finish_index):
                records[spec.request_id].finished_indices.add(spec.finish_index)
        if step_index in reset_steps:
            scheduler.reset()
            worker = digest_worker(config, vocab_size)
        scheduler.check_invariants()
        step = scheduler.schedule()
        if step is None:
            collect(records, scheduler.pop_pending_outputs())
            if step_index >= last_arrival and not scheduler.has_unfinished_requests():
                break
            if scheduler.has_unfinished_requests() and step_index >= last_arrival:
                raise AssertionError(f"nothing scheduled at step {step_index} with requests left")
        else:
            plan = step.plan
            if plan.num_tokens > config.max_num_batched_tokens or len(plan.seqs) > config.max_num_seqs:
                raise AssertionError(f"step {plan.step_id} exceeds the budget")
            scheduler.check_invariants()
            if on_step is not None:
                on_step(scheduler, plan)
            plans.append(plan)
            collect(records, scheduler.process_result(step, worker.run(plan)))
            scheduler.check_invariants()
        step_index += 1
        if step_index > max_steps:
            raise AssertionError("the workload did not finish")
    stats = scheduler.stats()
    if stats.gpu.num_used or stats.cpu.num_used or stats.gpu.num_free + stats.gpu.num_cached != stats.gpu.num_total:
        raise AssertionError(f"blocks leaked: {stats}")
    return RunResult(records=records, plans=plans, scheduler=scheduler)
