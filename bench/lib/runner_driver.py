"""Greedy generation straight through a ModelRunner (in-process, no scheduler): one prefill step for
a batch of prompts, then one decode step per new token for all of them together.

`generate_drafting` decodes with the runner's draft model instead (draft-model speculation): each
step every sequence has its drafts proposed and verified in one step.

Sequence i of a batch owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq) of the runner's
pool; the caller sizes the pool (`blocks_needed`, with max_new_tokens + the drafts per step when
drafting).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan
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


@dataclass
class DraftedGeneration:
    token_ids: list[list[int]]  # new tokens per prompt (max_new_tokens each)
    num_drafted: int  # drafts proposed by the runner's draft model
    num_accepted: int  # of which the target accepted
    num_verify_steps: int  # sequence-steps that drafted (each emits accepted + 1 tokens)
    seconds: float  # every step, the prefill included


def generate_drafting(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                      num_drafts: int) -> DraftedGeneration:
    """Greedy continuations with the runner's draft model proposing num_drafts tokens per sequence and
    step (StepPlan.drafts_from_worker), keeping the scheduler's bookkeeping of the draft KV: a
    sequence sends the tokens from num_draft_computed up to its last token t (position P) as the draft
    context, and after a accepted drafts num_draft_computed = P + 1 + min(a, num_drafts - 1)."""
    per_seq = blocks_per_seq(prompts, max_new_tokens + num_drafts, runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    tokens = [list(prompt) for prompt in prompts]
    num_draft_computed = [0] * len(prompts)
    step_id, num_drafted, num_accepted, num_verify_steps, seconds = 0, 0, 0, 0, 0.0

    def step(seqs: list[ScheduledSeq]) -> dict[int, list[int]]:
        nonlocal step_id, seconds
        step_id += 1
        started = time.perf_counter()
        result = runner.execute(StepPlan(step_id=step_id, seqs=seqs, drafts_from_worker=True))
        seconds += time.perf_counter() - started
        emitted: dict[int, list[int]] = {}
        for sample in result.samples:
            emitted.setdefault(sample.seq_id, []).append(sample.token_id)
        return emitted

    first = step([ScheduledSeq(seq_id=i, token_ids=list(prompt), start_position=0, block_table=tables[i],
                               sample=GREEDY) for i, prompt in enumerate(prompts)])
    for i in range(len(prompts)):
        tokens[i] += first[i]
    while True:
        running = [i for i, prompt in enumerate(prompts) if len(tokens[i]) - len(prompt) < max_new_tokens]
        if not running:
            break
        positions = {i: len(tokens[i]) - 1 for i in running}
        emitted = step([ScheduledSeq(
            seq_id=i, token_ids=[tokens[i][-1]] + [0] * num_drafts, start_position=positions[i], block_table=tables[i],
            sample=GREEDY, num_draft_tokens=num_drafts,
            draft_context_ids=tokens[i][num_draft_computed[i]:positions[i]],
            draft_start_position=num_draft_computed[i]) for i in running])
        for i in running:
            accepted = len(emitted[i]) - 1
            tokens[i] += emitted[i]
            num_draft_computed[i] = positions[i] + 1 + min(accepted, num_drafts - 1)
            num_drafted += num_drafts
            num_accepted += accepted
            num_verify_steps += 1
    return DraftedGeneration([seq[len(prompt):len(prompt) + max_new_tokens] for seq, prompt in zip(tokens, prompts)],
                             num_drafted, num_accepted, num_verify_steps, seconds)
