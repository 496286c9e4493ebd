"""A fake worker that simulates the KV cache slot by slot, and a driver that runs a Scheduler
against it. No torch, no processes.

The fake KV value of a slot chains the value before it with the token written there, so a slot
holds a digest of the whole prefix up to it. A sampled token is a function of every KV value of
the sequence's context (read through its block table) and its output index. Any block mix-up
(missing copy-on-write, wrong swap mapping, reuse of a live block, a stale prefix-cache hit)
changes the context values and therefore the tokens, so a run under memory pressure must give
exactly the tokens of a run with a huge pool.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.request_types import FinishReason, Request, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.scheduler_config import SchedulerConfig
from pagedserve.step_plan import ScheduledSeq, SeqSample, StepPlan, StepResult

VOCAB_SIZE = 24
EOS_TOKEN_ID = 0
_ROOT = 0x5EED


class FakeWorkerError(AssertionError):
    """The plan asked the fake worker for something a real one would get wrong."""


class FakeWorker:
    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.gpu: list[list[int | None]] = [[None] * config.block_size for _ in range(config.num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * config.block_size for _ in range(config.num_cpu_blocks)]
        self.plans: list[StepPlan] = []

    def run(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for gpu, cpu in plan.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for cpu, gpu in plan.blocks_to_swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        for src, dst in plan.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        seq_ids = [seq.seq_id for seq in plan.seqs]
        if len(set(seq_ids)) != len(seq_ids):
            raise FakeWorkerError(f"step {plan.step_id} schedules a sequence twice")
        written: dict[tuple[int, int], int] = {}
        for seq in plan.seqs:
            self._write(seq, written)
        samples = [self._sample(seq, written) for seq in plan.seqs if seq.sample is not None]
        return StepResult(step_id=plan.step_id, samples=samples, epoch=plan.epoch)

    def _slot(self, seq: ScheduledSeq, position: int) -> tuple[int, int]:
        block_index = position // self.block_size
        if block_index >= len(seq.block_table):
            raise FakeWorkerError(f"sequence {seq.seq_id}: position {position} outside its block table")
        return seq.block_table[block_index], position % self.block_size

    def _write(self, seq: ScheduledSeq, written: dict[tuple[int, int], int]) -> None:
        if len(seq.block_table) != -(-seq.context_len // self.block_size):
            raise FakeWorkerError(f"sequence {seq.seq_id}: {len(seq.block_table)} blocks for {seq.context_len} tokens")
        value = _ROOT if seq.start_position == 0 else self._read(seq, seq.start_position - 1, written)
        for offset, token_id in enumerate(seq.token_ids):
            block, slot = self._slot(seq, seq.start_position + offset)
            if (block, slot) in written:
                raise FakeWorkerError(f"block {block} slot {slot} written twice in step")
            value = hash((value, token_id)) & 0xFFFFFFFFFFFF
            self.gpu[block][slot] = value
            written[(block, slot)] = seq.seq_id

    def _read(self, seq: ScheduledSeq, position: int, written: dict[tuple[int, int], int]) -> int:
        block, slot = self._slot(seq, position)
        if written.get((block, slot), seq.seq_id) != seq.seq_id:
            raise FakeWorkerError(f"sequence {seq.seq_id} reads block {block} slot {slot} that another "
                                  f"sequence writes in the same step")
        value = self.gpu[block][slot]
        if value is None:
            raise FakeWorkerError(f"sequence {seq.seq_id} reads unwritten block {block} slot {slot}")
        return value

    def _sample(self, seq: ScheduledSeq, written: dict[tuple[int, int], int]) -> SeqSample:
        context = tuple(self._read(seq, position, written) for position in range(seq.context_len))
        spec = seq.sample
        seed = -1 if spec.seed is None else spec.seed  # hash(None) differs between processes
        rng = random.Random(hash((context, spec.output_index, seed)))
        allowed = [token for token in range(VOCAB_SIZE) if token not in spec.suppress_token_ids]
        logprobs = sorted((-rng.randrange(1, 4000) / 64.0 for _ in allowed), reverse=True)
        ranked = rng.sample(allowed, len(allowed))  # best first
        sample = SeqSample(seq_id=seq.seq_id, token_id=ranked[0], logprob=logprobs[0])
        if spec.num_logprobs:
            sample.top_token_ids = ranked[:spec.num_logprobs]
            sample.top_logprobs = logprobs[:spec.num_logprobs]
        if spec.num_beam_candidates:
            sample.beam_token_ids = ranked[:spec.num_beam_candidates]
            sample.beam_logprobs = logprobs[:spec.num_beam_candidates]
        return sample


@dataclass
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_step: int = 0
    abort_step: int | None = None  # abort before this step's schedule()
    finish_step: int | None = None  # finish_completion(finish_index) before this step
    finish_index: int = 0

    def request(self) -> Request:
        return Request(request_id=self.request_id, prompt_token_ids=list(self.prompt_token_ids),
                       sampling=self.sampling, eos_token_ids=[EOS_TOKEN_ID])


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
                 reset_steps: frozenset[int] = frozenset()) -> RunResult:
    """Drives a scheduler until every request ended; checks invariants after every step.

    At each of reset_steps the workers "restart": scheduler.reset() and a fresh fake KV cache.
    """
    scheduler = Scheduler(config)
    worker = FakeWorker(config)
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
            worker = FakeWorker(config)
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
