"""KV block accounting of the real Scheduler over a workload, driven by a deterministic fake worker.

The worker (no torch) keeps one digest per KV slot, chained over the tokens before it, and reads
the digest of a sequence's last slot through its block table to pick the next token, so
sequences that diverge (parallel samples, beams) keep diverging and beams that share a history
share it block for block. Beam candidates come from seeded Gaussian logits (a peaked,
model-like distribution); nothing else about the model matters for block counts.

Observers sample the pool right after schedule(), when every scheduled token already has its
slot; one observation per step:

    SharingObserver   distinct physical blocks of each request (Scheduler.num_blocks_of_request)
                      against the blocks its sequences would hold without sharing, or sharing
                      only the prompt
    WasteObserver     allocated slots against slots holding a token, for the paged pool and for
                      contiguous per-sequence reservations
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.request_types import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.scheduler_config import SchedulerConfig
from pagedserve.scheduler.sequence import SequenceGroup
from pagedserve.step_plan import ScheduledSeq, SeqSample, StepPlan, StepResult

VOCAB_SIZE = 64
FIRST_TOKEN_ID = 4  # ids below are special in the demo tokenizer; prompts and samples avoid them
LOGIT_STD = 2.0
_ROOT = 0x5EED
_MASK = (1 << 61) - 1


class DigestWorker:
    """Runs a StepPlan on fake KV: block operations first, then writes, then samples."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.gpu: dict[int, list[int]] = {}
        self.cpu: dict[int, list[int]] = {}

    def run(self, plan: StepPlan) -> StepResult:
        for gpu, cpu in plan.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for cpu, gpu in plan.blocks_to_swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        for src, dst in plan.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        samples = []
        for seq in plan.seqs:
            last_value = self._write(seq)
            if seq.sample is not None:
                samples.append(self._sample(seq, last_value))
        return StepResult(step_id=plan.step_id, samples=samples, epoch=plan.epoch)

    def _write(self, seq: ScheduledSeq) -> int:
        size = self.block_size
        position = seq.start_position
        if position == 0:
            value = _ROOT
        else:
            value = self.gpu[seq.block_table[(position - 1) // size]][(position - 1) % size]
        for token_id in seq.token_ids:
            block = self.gpu.setdefault(seq.block_table[position // size], [0] * size)
            value = hash((value, token_id)) & _MASK
            block[position % size] = value
            position += 1
        return value

    @staticmethod
    def _sample(seq: ScheduledSeq, last_value: int) -> SeqSample:
        spec = seq.sample
        rng = random.Random(hash((last_value, spec.output_index)) & _MASK)
        if not spec.num_beam_candidates:
            return SeqSample(seq_id=seq.seq_id, token_id=rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE), logprob=-1.0)
        logits = [rng.gauss(0.0, LOGIT_STD) for _ in range(VOCAB_SIZE)]
        peak = max(logits)
        log_total = peak + math.log(sum(math.exp(logit - peak) for logit in logits))
        ranked = sorted(range(FIRST_TOKEN_ID, VOCAB_SIZE), key=lambda token: -logits[token])
        best = ranked[:spec.num_beam_candidates]
        return SeqSample(seq_id=seq.seq_id, token_id=best[0], logprob=logits[best[0]] - log_total,
                         beam_token_ids=best, beam_logprobs=[logits[token] - log_total for token in best])


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload: EOS is ignored, so every completion has max_tokens tokens."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    n: int = 1
    beam_width: int = 1
    arrival_step: int = 0

    @property
    def kind(self) -> str:
        if self.beam_width > 1:
            return f"beam={self.beam_width}"
        return f"n={self.n}"

    def to_request(self) -> Request:
        rng = random.Random(f"prompt-{self.request_id}")
        prompt = [rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(self.num_prompt_tokens)]
        sampling = SamplingParams(max_tokens=self.max_tokens, ignore_eos=True, n=self.n, beam_width=self.beam_width,
                                  temperature=0.0 if self.beam_width > 1 else 1.0)
        return Request(request_id=self.request_id, prompt_token_ids=prompt, sampling=sampling)


Observer = Callable[[Scheduler, StepPlan], None]


def drive(config: SchedulerConfig, requests: list[WorkloadRequest], observer: Observer) -> int:
    """Runs the workload to its end (requests join at their arrival step); returns the number of
    steps that ran. Raises RuntimeError when nothing can be scheduled or a block leaks."""
    scheduler = Scheduler(config)
    worker = DigestWorker(config.block_size)
    pending = sorted(requests, key=lambda request: request.arrival_step)
    next_index = 0
    step_index = 0
    num_steps = 0
    while next_index < len(pending) or scheduler.has_unfinished_requests():
        while next_index < len(pending) and pending[next_index].arrival_step <= step_index:
            scheduler.add_request(pending[next_index].to_request())
            next_index += 1
        step_index += 1
        step = scheduler.schedule()
        if step is None:
            if scheduler.has_unfinished_requests():
                raise RuntimeError(f"nothing scheduled at step {step_index} with requests left")
            continue
        observer(scheduler, step.plan)
        scheduler.process_result(step, worker.run(step.plan))
        num_steps += 1
    stats = scheduler.stats()
    if stats.gpu.num_used or stats.cpu.num_used:
        raise RuntimeError(f"blocks still referenced after the workload: {stats}")
    return num_steps


def kv_lengths(group: SequenceGroup, context_lens: dict[int, int]) -> list[int]:
    """Tokens each live sequence of group holds in KV once this step's tokens are written.

    A follower that still waits for the leader's shared prefix (n > 1 before the fork) counts the
    leader's tokens: without sharing it would hold its own copy of them.
    """
    leader = group.seqs[0]
    leader_len = context_lens.get(leader.seq_id, leader.num_computed_tokens)
    lengths = []
    for seq in group.seqs:
        if seq is not leader and group.fork_at is not None:
            lengths.append(leader_len)
        else:
            lengths.append(context_lens.get(seq.seq_id, seq.num_computed_tokens))
    return lengths


@dataclass(slots=True)
class SharingObserver:
    """Per step, over the running requests, blocks held

        shared        distinct physical blocks (Scheduler.num_blocks_of_request)
        unshared      every sequence on its own: sum of ceil(len / block_size)
        prompt only   the full blocks of the prompt held once, everything after per sequence
    """

    block_size: int
    blocks_shared: list[int] = field(default_factory=list)
    blocks_unshared: list[int] = field(default_factory=list)
    blocks_prompt_only: list[int] = field(default_factory=list)

    def __call__(self, scheduler: Scheduler, plan: StepPlan) -> None:
        context_lens = {seq.seq_id: seq.context_len for seq in plan.seqs}
        size = self.block_size
        num_shared = num_unshared = num_prompt_only = 0
        for group in scheduler.running:
            num_shared += scheduler.num_blocks_of_request(group.request_id)
            lengths = kv_lengths(group, context_lens)
            num_prompt_blocks = min(group.num_prompt_tokens, *lengths) // size
            num_unshared += sum(-(-length // size) for length in lengths)
            num_prompt_only += num_prompt_blocks + sum(-(-length // size) - num_prompt_blocks for length in lengths)
        self.blocks_shared.append(num_shared)
        self.blocks_unshared.append(num_unshared)
        self.blocks_prompt_only.append(num_prompt_only)


@dataclass(slots=True)
class SlotSeries:
    """Allocated and filled KV slots per step for one way of holding the cache."""

    slots_allocated: list[int] = field(default_factory=list)
    slots_filled: list[int] = field(default_factory=list)

    def add(self, allocated: int, filled: int) -> None:
        self.slots_allocated.append(allocated)
        self.slots_filled.append(filled)

    def summary(self) -> dict:
        total_allocated = sum(self.slots_allocated)
        total_filled = sum(self.slots_filled)
        num_steps = max(len(self.slots_allocated), 1)
        return {"mean_slots_allocated": total_allocated / num_steps, "mean_slots_filled": total_filled / num_steps,
                "peak_slots_allocated": max(self.slots_allocated, default=0),
                "waste_percent": 100.0 * (1.0 - total_filled / total_allocated) if total_allocated else 0.0}


@dataclass(slots=True)
class WasteObserver:
    """Per step, over the running groups:

        paged            used blocks x block_size   vs distinct slots holding a token
        paged, unshared  sum over sequences of ceil(len / block_size) x block_size   vs sum of len
        reserve output   sum over sequences of (prompt + max_tokens)                  vs sum of len
        reserve max len  sum over sequences of max_model_len                          vs sum of len

    Reservations are made for every sequence a request will have (beam_width for beam search).
    It also counts the empty slots of partly filled last blocks, to show that the paged pool
    wastes nothing else.
    """

    block_size: int
    max_model_len: int
    paged: SlotSeries = field(default_factory=SlotSeries)
    paged_unshared: SlotSeries = field(default_factory=SlotSeries)
    reserve_output: SlotSeries = field(default_factory=SlotSeries)
    reserve_max_len: SlotSeries = field(default_factory=SlotSeries)
    last_block_empty_slots: list[int] = field(default_factory=list)
    running_seqs: list[int] = field(default_factory=list)

    def __call__(self, scheduler: Scheduler, plan: StepPlan) -> None:
        size = self.block_size
        context_lens = {seq.seq_id: seq.context_len for seq in plan.seqs}
        distinct: set[int] = set()
        last_fill: dict[int, int] = {}
        num_unshared_blocks = num_tokens = num_reserved = num_seqs_reserved = 0
        for group in scheduler.running:
            lengths = kv_lengths(group, context_lens)
            for seq, length in zip(group.seqs, lengths):
                table = seq.block_table
                if table:
                    distinct.update(table)
                    fill = length - (len(table) - 1) * size
                    if fill < size:
                        last_fill[table[-1]] = max(fill, last_fill.get(table[-1], 0))
                num_unshared_blocks += -(-length // size)
                num_tokens += length
            num_reservations = group.beam.beam_width if group.beam is not None else len(group.seqs)
            num_seqs_reserved += num_reservations
            num_reserved += num_reservations * min(group.num_prompt_tokens + group.max_output_tokens,
                                                   self.max_model_len)
        num_used = scheduler.block_manager.gpu_pool.num_used
        if num_used != len(distinct):
            raise RuntimeError(f"pool has {num_used} used blocks, running tables reference {len(distinct)}")
        filled = (len(distinct) - len(last_fill)) * size + sum(last_fill.values())
        self.paged.add(num_used * size, filled)
        self.last_block_empty_slots.append(sum(size - fill for fill in last_fill.values()))
        self.paged_unshared.add(num_unshared_blocks * size, num_tokens)
        self.reserve_output.add(num_reserved, num_tokens)
        self.reserve_max_len.add(num_seqs_reserved * self.max_model_len, num_tokens)
        self.running_seqs.append(sum(len(group.seqs) for group in scheduler.running))
