"""The step after a continuable one, computed before its plan arrives.

A plan the scheduler marks continuable (StepPlan.continuable: every sequence decodes one token it
samples, in a block it owns alone with room for the next position, under a spec that tokens do not
change, and nothing waits to be scheduled) is most likely followed by the same decode one position
on, each sequence feeding the token it just sampled. A single-rank worker computes that step right
after sending the result, while the scheduler turns the result into the next plan; when the plan
arrives and is that step (same sequences in the same order, tokens, positions, block tables or
tables that go on past them with a block taken ahead, specs, nothing else to do), the result computed ahead is the answer, the same tokens and log
probabilities the plan would give (the same inputs through the same code). Otherwise it is dropped
and the plan runs as usual.

What the step computed ahead wrote stays harmless: only the KV of each sequence's next position,
in a block that sequence owned alone. A sequence that finished meanwhile frees that block, and its
next owner writes every slot it reads; a sequence that goes on writes the same K/V there again.
The cost of a miss is one forward that the next plan waits for (a finished request, a new one).

A decode run (StepPlan.num_steps > 1, scheduler/core/continuable.py: a continuable plan, or one
of up to 32 sequences whose step after the run is not computed ahead) is computed the same way
without waiting for the plans in between: each step is the one before one
position on, and the result holds every step's samples; a run that streams its steps
(StepPlan.streams_steps) sends each step's result as soon as it is computed, then a result that
ends the run. A step that fails, or that next_plan cannot derive, ends the run before it; the
scheduler plans that step again like any other. So does any message from the scheduler waiting
to be read (EndRun: a request arrived or left), so that the next plan comes one step later, not
a run later. What a dropped step wrote is harmless as above.

next_plan derives nothing after a step that sampled one of the plan's end_token_ids (EOS unless
ignored, stop tokens): the sequence may have ended, so neither a run's later steps nor a step
ahead are computed for nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pagedserve.contracts.step_plan import ScheduledSeq, SeqSample, StepPlan, StepResult


def next_plan(plan: StepPlan, result: StepResult, block_size: int, in_run: bool = False) -> StepPlan | None:
    """The step most likely to follow `plan` given its result, or None when it is not continuable
    (in_run: a later step of a decode run, which any plan of the run may have, continuable or not)."""
    if not (plan.continuable or in_run) or result.failures or len(result.samples) != len(plan.seqs):
        return None
    if any(sample.token_id in plan.end_token_ids for sample in result.samples):
        return None  # a sequence may have ended (EOS, a stop token): the scheduler decides what follows
    tokens = {sample.seq_id: sample.token_id for sample in result.samples}
    seqs = []
    for seq in plan.seqs:
        position = seq.start_position + 1
        if (len(seq.token_ids) != 1 or seq.sample is None or seq.num_draft_tokens or seq.num_mask_rows
                or seq.lora_slot >= 0 or seq.seq_id not in tokens or position // block_size >= len(seq.block_table)):
            return None
        seqs.append(ScheduledSeq(seq.seq_id, [tokens[seq.seq_id]], position, seq.block_table, seq.sample))
    return StepPlan(step_id=plan.step_id + 1, seqs=seqs, epoch=plan.epoch, continuable=plan.continuable,
                    end_token_ids=plan.end_token_ids)


def run_steps(result: StepResult, plan: StepPlan, block_size: int,
              try_execute: Callable[[StepPlan], StepResult | None],
              should_end: Callable[[], bool],
              send: Callable[[StepResult], None] | None = None,
              steps_after: Callable[[StepResult], Callable | None] | None = None,
              ) -> tuple[StepResult, StepPlan, StepResult]:
    """`result` (of `plan`'s first step) with the later steps of its decode run (module doc) when
    plan is one, computed by try_execute (None: that step failed, which ends the run); the run also
    ends when should_end() (a message from the scheduler waits: a request arrived or left). Also
    returns the last step computed and its own result, which the step after the run follows.

    A run that streams its steps (StepPlan.streams_steps) hands each step's result to `send` as
    soon as it is computed (StepResult.run_step), and returns the result that ends the run.

    steps_after(result), where it gives a call (ModelRunner.steps_after: the kept decode run
    computed result), computes the later steps instead of try_execute: the same steps from the
    same tokens, without a plan per step (the last one is built at the end). Where that call has a
    `many` (worker/decode_run.py LaterSteps) and the run does not stream, all of them in one call,
    which checks for a waiting message itself (its own poll stands for should_end). A run that
    streams keeps a call per step: one native call per step measured no shorter at its edges
    through `serve` (one stream, four alternated pairs, bfloat16 and Q4_1), where the frontend's
    and the client's work for each token share the cores."""
    streams = send is not None and plan.streams_steps and plan.num_steps > 1
    if streams:
        send(replace(result, run_step=1))
    advance = steps_after(result) if steps_after is not None and plan.num_steps > 1 else None
    many = getattr(advance, "many", None)
    if many is not None and not streams:
        return _steps_in_one_call(many, result, plan)
    last, last_result, num_steps = plan, result, 1
    samples, forward_seconds = result.samples, result.forward_seconds
    fed: list[int] | None = None  # the tokens the last step fed, where `advance` computed it
    while num_steps < plan.num_steps and not should_end():
        if advance is not None:
            step = _step_through(advance, plan, last_result)
            if step is None:
                break
            fed, step_result = step
        else:
            following = next_plan(last, last_result, block_size, in_run=True)
            if following is None:
                break
            following.step_id = plan.step_id
            step_result = try_execute(following)
            if step_result is None or step_result.failures or len(step_result.samples) != len(plan.seqs):
                break
            last = following
        if streams:
            send(replace(step_result, run_step=num_steps + 1))
        else:
            if num_steps == 1:
                samples = list(samples)
            samples += step_result.samples
        forward_seconds += step_result.forward_seconds
        last_result, num_steps = step_result, num_steps + 1
    if fed is not None:
        last = _plan_at(plan, fed, num_steps - 1)
    if streams:
        result = StepResult(plan.step_id, [], forward_seconds, plan.epoch, num_steps=num_steps)
    elif num_steps > 1:
        result = StepResult(plan.step_id, samples, forward_seconds, plan.epoch, num_steps=num_steps)
    return result, last, last_result


def _steps_in_one_call(many: Callable, result: StepResult, plan: StepPlan) -> tuple[StepResult, StepPlan, StepResult]:
    """run_steps' later steps of a run that does not stream, through `many` (LaterSteps.many): the
    same samples, result, last plan and last result as its loop gives."""
    fed = [sample.token_id for sample in result.samples]
    computed = many(fed, plan.num_steps - 1, plan.end_token_ids)
    ids, logprobs, seconds = computed if computed is not None else ([], [], [])
    num_rows = len(plan.seqs)
    num_later = len(ids) // num_rows
    if not num_later:
        return result, plan, result
    seq_ids = [sample.seq_id for sample in result.samples]
    samples = list(result.samples)
    samples += [SeqSample(seq_id=seq_id, token_id=token_id, logprob=logprob)
                for seq_id, token_id, logprob in zip(seq_ids * num_later, ids, logprobs)]
    last_fed = ids[-2 * num_rows:-num_rows] if num_later > 1 else fed
    last_result = StepResult(step_id=plan.step_id, samples=samples[-num_rows:], forward_seconds=seconds[-1],
                             epoch=plan.epoch)
    total = StepResult(plan.step_id, samples, result.forward_seconds + sum(seconds), plan.epoch,
                       num_steps=num_later + 1)
    return total, _plan_at(plan, last_fed, num_later), last_result


def _step_through(advance: Callable, plan: StepPlan, last_result: StepResult) -> tuple[list[int], StepResult] | None:
    """The step after last_result through `advance` (run_steps): the tokens fed and its result, or
    None where next_plan would derive no step (a token that may end its sequence) or advance
    computed none."""
    fed = [sample.token_id for sample in last_result.samples]
    if any(token in plan.end_token_ids for token in fed):
        return None
    computed = advance(fed)
    if computed is None:
        return None
    ids, logprobs, forward_seconds = computed
    samples = [SeqSample(seq_id=sample.seq_id, token_id=token_id, logprob=logprob)
               for sample, token_id, logprob in zip(last_result.samples, ids, logprobs)]
    return fed, StepResult(step_id=plan.step_id, samples=samples, forward_seconds=forward_seconds, epoch=plan.epoch)


def _plan_at(plan: StepPlan, fed: list[int], offset: int) -> StepPlan:
    """The plan next_plan derives for a run's step `offset` positions after plan's, feeding `fed`."""
    seqs = [ScheduledSeq(seq.seq_id, [token], seq.start_position + offset, seq.block_table, seq.sample)
            for seq, token in zip(plan.seqs, fed)]
    return StepPlan(step_id=plan.step_id, seqs=seqs, epoch=plan.epoch, continuable=plan.continuable,
                    end_token_ids=plan.end_token_ids)


def is_same_step(ahead: StepPlan, plan: StepPlan) -> bool:
    """Whether `plan` asks for exactly the step computed ahead."""
    return (plan.step_id == ahead.step_id and plan.epoch == ahead.epoch and len(plan.seqs) == len(ahead.seqs)
            and not (plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.blocks_to_copy or plan.lora_loads
                     or plan.drafts_from_worker or plan.masks_follow)
            and (plan.tier_ops is None or plan.tier_ops.is_empty)
            and all(_same_seq(a, b) for a, b in zip(ahead.seqs, plan.seqs)))


def _same_seq(ahead: ScheduledSeq, seq: ScheduledSeq) -> bool:
    """The same decode; the plan's table may go on past the one computed with (a block the
    scheduler took ahead, scheduler/core/continuable.py), which that step neither read nor wrote."""
    return (seq.seq_id == ahead.seq_id and seq.token_ids == ahead.token_ids
            and seq.start_position == ahead.start_position
            and seq.block_table[:len(ahead.block_table)] == ahead.block_table
            and seq.sample == ahead.sample and not seq.num_draft_tokens and not seq.num_mask_rows
            and seq.lora_slot == ahead.lora_slot)
