"""The step after a continuable one, computed before its plan arrives.

A plan the scheduler marks continuable (StepPlan.continuable: every sequence decodes one token it
samples, in a block it owns alone with room for the next position, under a spec that tokens do not
change, and nothing waits to be scheduled) is most likely followed by the same decode one position
on, each sequence feeding the token it just sampled. A single-rank worker computes that step right
after sending the result, while the scheduler turns the result into the next plan; when the plan
arrives and is that step (same sequences in the same order, tokens, positions, block tables,
specs, nothing else to do), the result computed ahead is the answer, the same tokens and log
probabilities the plan would give (the same inputs through the same code). Otherwise it is dropped
and the plan runs as usual.

What the step computed ahead wrote stays harmless: only the KV of each sequence's next position,
in a block that sequence owned alone. A sequence that finished meanwhile frees that block, and its
next owner writes every slot it reads; a sequence that goes on writes the same K/V there again.
The cost of a miss is one forward that the next plan waits for (a finished request, a new one).
"""

from __future__ import annotations

from pagedserve.contracts.step_plan import ScheduledSeq, StepPlan, StepResult


def next_plan(plan: StepPlan, result: StepResult, block_size: int) -> StepPlan | None:
    """The step most likely to follow `plan` given its result, or None when it is not continuable."""
    if not plan.continuable or result.failures or len(result.samples) != len(plan.seqs):
        return None
    tokens = {sample.seq_id: sample.token_id for sample in result.samples}
    seqs = []
    for seq in plan.seqs:
        position = seq.start_position + 1
        if (len(seq.token_ids) != 1 or seq.sample is None or seq.num_draft_tokens or seq.num_mask_rows
                or seq.lora_slot >= 0 or seq.seq_id not in tokens or position // block_size >= len(seq.block_table)):
            return None
        seqs.append(ScheduledSeq(seq.seq_id, [tokens[seq.seq_id]], position, seq.block_table, seq.sample))
    return StepPlan(step_id=plan.step_id + 1, seqs=seqs, epoch=plan.epoch)


def is_same_step(ahead: StepPlan, plan: StepPlan) -> bool:
    """Whether `plan` asks for exactly the step computed ahead."""
    return (plan.step_id == ahead.step_id and plan.epoch == ahead.epoch and len(plan.seqs) == len(ahead.seqs)
            and not (plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.blocks_to_copy or plan.lora_loads
                     or plan.drafts_from_worker or plan.masks_follow)
            and (plan.tier_ops is None or plan.tier_ops.is_empty)
            and all(_same_seq(a, b) for a, b in zip(ahead.seqs, plan.seqs)))


def _same_seq(ahead: ScheduledSeq, seq: ScheduledSeq) -> bool:
    return (seq.seq_id == ahead.seq_id and seq.token_ids == ahead.token_ids
            and seq.start_position == ahead.start_position and seq.block_table == ahead.block_table
            and seq.sample == ahead.sample and not seq.num_draft_tokens and not seq.num_mask_rows
            and seq.lora_slot == ahead.lora_slot)
