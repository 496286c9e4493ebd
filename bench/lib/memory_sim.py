"""KV block accounting of the real Scheduler over a workload, driven by a deterministic fake worker.

The worker (pagedserve/testing/digest_worker.py, no torch) keeps one digest per KV slot, chained over the
tokens before it, and picks the next token from the digests of a sequence's context read through
its block table, so sequences that diverge (parallel samples, beams) keep diverging and beams that
share a history share it block for block. Candidates come from seeded Gaussian logits (a peaked,
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

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.testing.digest_worker import DigestWorker
from pagedserve.contracts.request_types import Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import SequenceGroup
from pagedserve.contracts.step_plan import StepPlan

VOCAB_SIZE = 64
LOGIT_STD = 2.0
FIRST_TOKEN_ID = 4  # ids below are special in the demo tokenizer; prompts and samples avoid them


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
    worker = DigestWorker.for_config(config, vocab_size=VOCAB_SIZE, first_token_id=FIRST_TOKEN_ID,
                                     logit_std=LOGIT_STD)
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
