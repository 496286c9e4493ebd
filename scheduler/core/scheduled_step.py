"""One built step: its StepPlan plus what process_result needs to interpret the StepResult, and
the structured-output bitmask rows computed after the plan was published (masks_follow)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.contracts.step_plan import ScheduledSeq, StepPlan
from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup
from pagedserve.scheduler.structured_output.sequences import fill_masks


@dataclass(slots=True)
class ScheduledStep:
    """A StepPlan plus what process_result needs to interpret its StepResult."""

    plan: StepPlan
    sampled: list[tuple[SequenceGroup, Sequence]]  # aligned with the plan's sequences that sample
    groups: list[SequenceGroup]  # every group with a sequence in the plan
    num_prefill_tokens: int = 0  # tokens of sequences with more than one token in this step
    num_decode_tokens: int = 0  # a sequence verifying drafts counts one, its drafts not
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    # Structured output with deferred masks: constrained sampling sequences whose bitmask rows
    # fill_masks() computes after the plan was published (the plan says masks_follow).
    pending_masks: list[tuple[ScheduledSeq, Sequence]] = field(default_factory=list)
    vocab_size: int = 0
    num_streamed_steps: int = 0  # of a run that streams its steps: those applied so far

    def fill_masks(self) -> None:
        """Computes the deferred bitmask rows into the plan's sequences (nothing changes the
        matchers between schedule() and process_result(), so they are those of the plan)."""
        for scheduled, seq in self.pending_masks:
            fill_masks(scheduled, seq, self.vocab_size)
