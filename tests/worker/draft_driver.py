"""A scheduler stand-in for draft-model speculation: the design's bookkeeping of draft KV.

Every plan has drafts_from_worker. A sequence drafting K tokens in a step is scheduled as

    token_ids            [t, 0 x K]                 t = its last token, at position P
    draft_context_ids    tokens[num_draft_computed : P],  draft_start_position = num_draft_computed

and after the worker emitted a + 1 tokens (a drafts accepted) the sequence keeps

    num_computed        = P + 1 + a              target KV of t and the accepted drafts
    num_draft_computed  = P + 1 + min(a, K - 1)  the draft saw t, d1 .. d(K-1), never dK

num_draft_computed starts at 0 (also for a sequence whose prompt blocks were cached) and is
reset to 0 after a preemption. A spec with penalties gets the sequence's outputs so far, as the
scheduler sends them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plan_driver import DrivenSeq, PlanDriver

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan, StepResult


def _spec_now(seq: DrivenSeq) -> SampleSpec:
    spec = seq.spec
    if spec.repetition_penalty == 1.0 and spec.presence_penalty == 0.0 and spec.frequency_penalty == 0.0:
        return spec
    return dataclasses.replace(spec, prompt_token_ids=list(seq.prompt), output_token_ids=list(seq.generated))


@dataclass
class DraftedSeq(DrivenSeq):
    num_draft_computed: int = 0
    num_drafted: int = 0  # drafts proposed so far
    num_accepted: int = 0  # of which accepted


class DraftDriver(PlanDriver):
    """PlanDriver whose steps may draft: step(work, drafts={seq_id: K})."""

    def step(self, work: list[tuple[DrivenSeq, int]], *, drafts: dict[int, int] | None = None, swap_out=(),
             swap_in=(), copy=()) -> StepResult:
        drafts = drafts or {}
        scheduled = []
        for seq, count in work:
            num_drafts = drafts.get(seq.seq_id, 0)
            end = seq.num_computed + count
            if not 0 < count <= seq.num_pending:
                raise ValueError(f"seq {seq.seq_id}: {count} tokens asked, {seq.num_pending} pending")
            if num_drafts and not (count == 1 and end == len(seq.tokens)):
                raise ValueError(f"seq {seq.seq_id}: only a sequence computing its last token drafts")
            self.allocate(seq, end + num_drafts)
            samples = end == len(seq.tokens)
            position = end - 1
            scheduled.append(ScheduledSeq(
                seq_id=seq.seq_id, token_ids=seq.tokens[seq.num_computed:end] + [0] * num_drafts,
                start_position=seq.num_computed, block_table=list(seq.block_table),
                sample=_spec_now(seq) if samples else None, num_draft_tokens=num_drafts,
                draft_context_ids=seq.tokens[seq.num_draft_computed:position] if num_drafts else [],
                draft_start_position=seq.num_draft_computed if num_drafts else position))
        self.step_id += 1
        plan = StepPlan(step_id=self.step_id, seqs=scheduled, blocks_to_swap_out=list(swap_out),
                        blocks_to_swap_in=list(swap_in), blocks_to_copy=list(copy), drafts_from_worker=True)
        result = self.runner.execute(plan)
        assert not result.failures, result.failures
        self.plans.append(plan)
        emitted: dict[int, list[int]] = {}
        for sample in result.samples:
            emitted.setdefault(sample.seq_id, []).append(sample.token_id)
        if self.share_samples is not None:
            emitted = self.share_samples(emitted)
        for seq, count in work:
            num_drafts = drafts.get(seq.seq_id, 0)
            seq.num_computed += count
            if seq.num_computed < len(seq.tokens):
                continue
            tokens = emitted[seq.seq_id]
            assert 1 <= len(tokens) <= num_drafts + 1
            num_accepted = len(tokens) - 1
            position = seq.num_computed - 1
            seq.tokens += tokens
            seq.num_computed = position + 1 + num_accepted
            if num_drafts:
                seq.num_draft_computed = position + 1 + min(num_accepted, num_drafts - 1)
                seq.num_drafted += num_drafts
                seq.num_accepted += num_accepted
        self.results.append(result)
        return result

    def run_to_completion(self, seqs: list[DrivenSeq], token_budget: int | None = None,
                          num_drafts: int | dict[int, int] = 0) -> None:
        """Decodes (drafting num_drafts, per sequence when a dict) first, then prefill chunks within token_budget."""
        while not all(seq.is_finished for seq in seqs):
            work, budget, drafts = [], token_budget if token_budget is not None else 1 << 30, {}
            decodes = [seq for seq in seqs if not seq.is_finished and seq.num_computed >= len(seq.prompt)]
            prefills = [seq for seq in seqs if not seq.is_finished and seq.num_computed < len(seq.prompt)]
            for seq in decodes:
                work.append((seq, seq.num_pending))
                budget -= seq.num_pending
                k = num_drafts.get(seq.seq_id, 0) if isinstance(num_drafts, dict) else num_drafts
                if k:
                    drafts[seq.seq_id] = k
            for seq in prefills:
                count = min(seq.num_pending, budget)
                if count > 0:
                    work.append((seq, count))
                    budget -= count
            self.step(work, drafts=drafts)
