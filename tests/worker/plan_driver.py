"""A minimal stand-in for the scheduler: free-list block allocation and hand-built StepPlans.

Tests decide what each step computes (which sequences, how many new tokens); the driver turns
that into ScheduledSeqs with correct start positions, block tables and sample specs, runs the
ModelRunner and appends sampled tokens.
"""

from __future__ import annotations

from contextlib import contextmanager

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan, StepResult
from pagedserve.worker.model_runner import ModelRunner


@dataclass
class DrivenSeq:
    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    spec: SampleSpec = field(default_factory=SampleSpec)
    lora_slot: int = -1  # the worker's adapter slot (-1: the base model)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def is_finished(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last sampled token."""
        return len(self.tokens) - self.num_computed


class PlanDriver:
    def __init__(self, runner: ModelRunner, num_blocks: int,
                 share_samples: Callable[[dict[int, int]], dict[int, int]] | None = None) -> None:
        """share_samples: with tensor parallelism, hands rank 0's {seq_id: token} to every rank."""
        self.runner = runner
        self.share_samples = share_samples
        self.block_size = runner.block_size
        self.free_blocks = list(range(num_blocks))[::-1]
        self.step_id = 0
        self.plans: list[StepPlan] = []
        self.results: list[StepResult] = []

    def allocate(self, seq: DrivenSeq, num_tokens: int) -> None:
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self.free_blocks.pop())

    def free(self, seq: DrivenSeq) -> None:
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []

    def step(self, work: list[tuple[DrivenSeq, int]], *, swap_out=(), swap_in=(), copy=(),
             lora_loads=()) -> StepResult:
        """Computes `count` pending tokens of each (seq, count); samples where the prompt is done."""
        scheduled = []
        for seq, count in work:
            if not 0 < count <= seq.num_pending:
                raise ValueError(f"seq {seq.seq_id}: {count} tokens asked, {seq.num_pending} pending")
            end = seq.num_computed + count
            self.allocate(seq, end)
            samples = end == len(seq.tokens)
            scheduled.append(ScheduledSeq(seq_id=seq.seq_id, token_ids=seq.tokens[seq.num_computed:end],
                                          start_position=seq.num_computed, block_table=list(seq.block_table),
                                          sample=seq.spec if samples else None, lora_slot=seq.lora_slot))
        self.step_id += 1
        plan = StepPlan(step_id=self.step_id, seqs=scheduled, blocks_to_swap_out=list(swap_out),
                        blocks_to_swap_in=list(swap_in), blocks_to_copy=list(copy), lora_loads=list(lora_loads))
        result = self.runner.execute(plan)
        self.plans.append(plan)
        sampled = {sample.seq_id: sample.token_id for sample in result.samples}
        if self.share_samples is not None:
            sampled = self.share_samples(sampled)
        for seq, count in work:
            seq.num_computed += count
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(sampled[seq.seq_id])
        self.results.append(result)
        return result

    def run_to_completion(self, seqs: list[DrivenSeq], token_budget: int | None = None, lora_loads=()) -> None:
        """Steps until every seq is finished: decodes first, then prefill chunks within token_budget;
        lora_loads go with the first step."""
        while not all(seq.is_finished for seq in seqs):
            work, budget = [], token_budget if token_budget is not None else 1 << 30
            decodes = [seq for seq in seqs if not seq.is_finished and seq.num_computed >= len(seq.prompt)]
            prefills = [seq for seq in seqs if not seq.is_finished and seq.num_computed < len(seq.prompt)]
            for seq in decodes + prefills:
                count = min(seq.num_pending, budget)
                if count > 0:
                    work.append((seq, count))
                    budget -= count
            self.step(work, lora_loads=lora_loads)
            lora_loads = ()


@contextmanager
def tensor_parallel_rank(path: str, rank: int, world_size: int, init_file: str, num_blocks: int,
                         **runner_options):
    """(runner, driver) of one rank of a gloo tensor-parallel group on the CPU, one torch thread:
    the float32 ModelRunner (with runner_options) loaded with a num_blocks pool, and a PlanDriver
    whose samples rank 0 broadcasts to the others. The process group is destroyed when the block
    ends."""
    import torch
    import torch.distributed as dist

    from pagedserve.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        runner = ModelRunner(path, device="cpu", dtype="float32", block_size=16, rank=rank, world_size=world_size,
                             **runner_options)
        runner.load()
        runner.init_cache(num_blocks, 0)

        def share(samples: dict[int, int]) -> dict[int, int]:
            box = [samples]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        yield runner, PlanDriver(runner, num_blocks, share_samples=share)
    finally:
        dist.destroy_process_group()
