"""Greedy generation straight through a ModelRunner (in-process, no scheduler): one prefill step for
a batch of prompts, then one decode step per new token for all of them together.

Sequence i of a batch owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq) of the runner's
pool; the caller sizes the pool (`blocks_needed`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.step_plan import SampleSpec, ScheduledSeq, StepPlan
from pagedserve.worker.model_runner import ModelRunner

GREEDY = SampleSpec()


@dataclass
class Generation:
    token_ids: list[list[int]]  # new tokens per prompt
    prefill_seconds: float
    decode_seconds: float  # all decode steps together
    num_decode_steps: int


def blocks_per_seq(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    return -(-(max(len(prompt) for prompt in prompts) + max_new_tokens) // block_size)


def blocks_needed(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    return len(prompts) * blocks_per_seq(prompts, max_new_tokens, block_size)


def generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int) -> Generation:
    """Greedy continuations of every prompt, all decoded in one batch."""
    per_seq = blocks_per_seq(prompts, max_new_tokens, runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    tokens = [list(prompt) for prompt in prompts]
    step_id = 0

    def step(seqs: list[ScheduledSeq]) -> float:
        nonlocal step_id
        step_id += 1
        started = time.perf_counter()
        result = runner.execute(StepPlan(step_id=step_id, seqs=seqs))
        seconds = time.perf_counter() - started
        by_seq = {sample.seq_id: sample.token_id for sample in result.samples}
        for i in range(len(prompts)):
            tokens[i].append(by_seq[i])
        return seconds

    prefill = step([ScheduledSeq(seq_id=i, token_ids=list(prompt), start_position=0, block_table=tables[i],
                                 sample=GREEDY) for i, prompt in enumerate(prompts)])
    decode = 0.0
    for _ in range(max_new_tokens - 1):
        decode += step([ScheduledSeq(seq_id=i, token_ids=[seq[-1]], start_position=len(seq) - 1,
                                     block_table=tables[i], sample=GREEDY) for i, seq in enumerate(tokens)])
    return Generation([seq[len(prompt):] for seq, prompt in zip(tokens, prompts)], prefill, decode,
                      max_new_tokens - 1)
