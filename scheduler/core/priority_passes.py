"""The passes of one step under --scheduling-policy priority (step_builder.py, pass 0 and the
merged passes 2 and 3): the first queued group preempts running groups of strictly lower priority
until it would fit, and swapped and waiting groups start in one (priority, arrival) order.

A part of StepBuilder (its base class): the passes use the builder's budget, preemption, swap-in
and admission.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.scheduler.core.sequence import GroupStatus, SequenceGroup

if TYPE_CHECKING:
    from pagedserve.scheduler.core.step_builder import StepBuilder


class PriorityPasses:
    def _next_queued(self: StepBuilder) -> SequenceGroup | None:
        """The swapped or waiting group that comes first by (priority, arrival)."""
        swapped, waiting = self.scheduler.swapped, self.scheduler.waiting
        if swapped and (not waiting or swapped[0].queue_key < waiting[0].queue_key):
            return swapped[0]
        return waiting[0] if waiting else None

    def _preempt_for_priority(self: StepBuilder) -> None:
        """The first queued group (swapped or waiting) preempts running groups of strictly lower
        priority, lowest priority and newest first, until it would fit; equal priorities never
        preempt each other. Done before pass 1, so no victim has tokens in this step yet."""
        candidate = self._next_queued()
        running = self.scheduler.running
        if candidate is None:
            return
        while running and running[-1].priority > candidate.priority and not self._would_fit(candidate):
            self._preempt(running[-1])
            self.num_priority_preemptions += 1

    def _would_fit(self: StepBuilder, group: SequenceGroup) -> bool:
        """Whether group could start now beside the running groups: a sequence slot each, and
        blocks for its first chunk (or its swapped blocks) plus one new block per running
        sequence at a block boundary. Prefix-cache hits are not counted (a safe overestimate)."""
        config = self.scheduler.config
        running = self.scheduler.running
        if sum(other.max_num_running_seqs for other in running) + group.max_num_running_seqs > config.max_num_seqs:
            return False
        size = self.block_manager.block_size
        num_needed = sum(1 for other in running for seq in other.seqs
                         if seq.num_computed_tokens % size == 0)
        if group.status is GroupStatus.SWAPPED:
            num_needed += self.block_manager.num_distinct_blocks(group.seqs) + len(group.seqs)
        else:
            leader = group.seqs[0]
            num_needed += config.num_blocks_for(min(len(leader.token_ids), config.max_num_batched_tokens))
        return num_needed <= self.block_manager.gpu_pool.num_available

    def _swap_in_and_admit_by_priority(self: StepBuilder, num_free_slots: int) -> None:
        """Passes 2 and 3 merged: swapped and waiting groups in one (priority, arrival) order;
        the first that does not fit stops both."""
        while self.num_tokens_left > 0:
            group = self._next_queued()
            if group is None:
                return
            if group.status is GroupStatus.SWAPPED:
                is_started = self._try_swap_in(group, num_free_slots)
            else:
                is_started = self._try_admit(group, num_free_slots)
            if not is_started:
                return
            num_free_slots -= group.max_num_running_seqs
