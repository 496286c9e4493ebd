"""Builds one step: which tokens of which sequences to compute, within the step budget.

Order of service, first come first served inside each pass (under --scheduling-policy priority,
"oldest" reads "first by (priority, arrival)": every queue is kept in that order):

    0. priority policy only: the first swapped or waiting group preempts running groups of
       strictly lower priority (lowest, newest first) until it would fit (_preempt_for_priority);
       passes 2 and 3 then run as one merged pass in (priority, arrival) order.

    1. running groups, oldest first: their decodes are reserved budget up front, so a long
       prefill chunk of an older group never starves a newer group's decode; prefill chunks
       (a prompt in progress, or a preempted group computing its tokens again) get what is left.
       A group that needs blocks the pool lacks preempts running groups, newest first (possibly
       itself), until they fit (preemption.py).
    2. swapped groups, oldest first, swapped back in while they fit (not after a preemption).
    3. waiting groups, oldest first, admitted while they fit (not while any group is swapped or
       after a preemption); the first that does not fit stops admission. A prompt's cached
       prefix continues from the device pool into the KV tiers (scheduler/kv/tiers): host hits
       are loaded into fresh blocks (each costs tier_load_tokens_per_block of the budget); keys
       only on disk are fetched and the group waits one step (admission stops there).

    budget:  max_num_batched_tokens  [ decodes ][ prefill chunks ........ ][ unused ]
             max_num_seqs            one slot per scheduled sequence

Speculation (spec_drafting.py): in pass 1 a running group's decoding sequences may get proposals
appended before its chunks are planned; they are verified as one chunk of k + 1 tokens each. With
a draft model the proposals are placeholders (StepPlan.drafts_from_worker), and each drafting
sequence also names the tokens before its last one whose draft KV it has not computed yet:

    positions      0 .. num_draft_computed - 1 | num_draft_computed .. p - 1 | p (t) | p+1 .. p+k
    draft KV       computed by earlier steps   | draft_context_ids           | this step's draft forwards

Structured output: every constrained sequence that samples carries its token bitmask rows
(structured_output/sequences.py fill_masks), computed from its matcher as the plan is built, or
with defer_masks (the engine) by ScheduledStep.fill_masks() once the plan is on its way: the
plan then only says how many rows each sequence has (masks_follow).

LoRA (scheduler/lora/slot_table.py): a group of an adapter request is scheduled only in a step
where its adapter has a worker slot; running groups claim slots first, oldest first, then
swapped and waiting groups in their queue order, and a queued group that gets none stops its
pass like one that lacks blocks. Each scheduled sequence names its slot, and the plan lists the
adapters the workers load before the forward.

Continuable steps (continuable.py): a plan of a few in-place decodes, nothing else pending, says so,
and a single-rank worker computes the step after it ahead, or, within each sequence's block and
answer, a decode run: up to num_steps steps of it in a row, which OutputProcessor applies as the
steps they are, all at once or, when a request streams, each as it comes.

Beam search steps all live beams together: a beam group samples only in a step where every beam
computes its whole tail; otherwise its beams compute up to their last token and sample later.
"""

from __future__ import annotations

from bisect import insort
from typing import TYPE_CHECKING

from pagedserve.scheduler.core.priority_passes import PriorityPasses
from pagedserve.scheduler.core.continuable import (MAX_RUN_SEQS, MAX_RUN_STEPS,
                                                   has_static_decode_spec, is_continuable_step,
                                                   is_predictable_decode, is_run_step, run_length,
                                                   wants_block_ahead)
from pagedserve.scheduler.core.chunk_planning import Chunk, num_decode_tokens, plan_chunks
from pagedserve.scheduler.core.preemption import choose_victim, preempt
from pagedserve.scheduler.core.scheduled_step import ScheduledStep
from pagedserve.scheduler.core.sample_specs import sample_spec_for
from pagedserve.scheduler.core.sequence import GroupStatus, Sequence, SequenceGroup
from pagedserve.scheduler.speculation.drafting import Drafter, drop_group_drafts, drop_unscheduled_drafts
from pagedserve.contracts.step_plan import ScheduledSeq, StepPlan
from pagedserve.scheduler.lora.step_slots import StepAdapterSlots
from pagedserve.scheduler.structured_output.sequences import fill_masks

if TYPE_CHECKING:
    from pagedserve.scheduler.core.scheduler import Scheduler


class StepBuilder(PriorityPasses):
    """One schedule() call; mutates the scheduler's queues and tables as it goes."""

    def __init__(self, scheduler: Scheduler, defer_masks: bool = False) -> None:
        self.scheduler = scheduler
        self.defer_masks = defer_masks
        self.pending_masks: list[tuple[ScheduledSeq, Sequence]] = []
        self.block_manager = scheduler.block_manager
        config = scheduler.config
        self.drafts_from_worker = config.is_draft_model_speculation
        self.num_tokens_left = config.max_num_batched_tokens
        self.num_seqs_left = config.max_num_seqs
        self.scheduled: list[ScheduledSeq] = []
        self.sampled: list[tuple[SequenceGroup, Sequence]] = []
        self.groups: list[SequenceGroup] = []
        self.emitted: list[tuple[SequenceGroup, Sequence]] = []
        self.blocks_to_swap_out: list[tuple[int, int]] = []
        self.blocks_to_swap_in: list[tuple[int, int]] = []
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_draft_tokens = 0  # speculative proposals verified in this step
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of num_preemptions, those made for a higher priority
        self.adapter_slots = StepAdapterSlots(scheduler.lora_slots)
        self.num_continuable = 0  # scheduled decodes whose next step the worker may compute itself
        self.num_run_steps = MAX_RUN_STEPS  # the longest continuable decode run every such decode allows
        self.num_run_steps_through_last = MAX_RUN_STEPS  # the same, up to the last tokens (run_length)
        self.streams_steps = False  # a continuable decode's request reads tokens as they come
        self.speculates = False  # proposals may come in any step: the next step is not predictable

    def build(self, step_id: int, epoch: int) -> ScheduledStep | None:
        is_priority_policy = self.scheduler.config.is_priority_policy
        if is_priority_policy:
            self._preempt_for_priority()
        self._schedule_running()
        if self.num_preemptions == self.num_priority_preemptions:  # none for lack of blocks
            num_free_slots = self.scheduler.config.max_num_seqs - sum(
                group.max_num_running_seqs for group in self.scheduler.running)
            if is_priority_policy:
                self._swap_in_and_admit_by_priority(num_free_slots)
            else:
                num_free_slots = self._swap_in(num_free_slots)
                if not self.scheduler.swapped:
                    self._admit_waiting(num_free_slots)
        # Blocks filled in this step become findable only now: a prefix hit in the same step
        # would read KV that this step's forward is still writing.
        register = self.block_manager.prefix_cache.register_computed
        for _, seq in self.emitted:
            if not seq.num_draft_tokens:  # drafting sequences register after verification
                register(seq)
        tiers = self.block_manager.tiers
        tier_ops = tiers.take_ops(self.block_manager.gpu_pool) if tiers is not None else None
        lora_loads = self.adapter_slots.take_loads()
        if not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or tier_ops or lora_loads):
            return None
        is_run = is_run_step(
            self.scheduler, len(self.scheduled), self.num_continuable, self.speculates,
            bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy or tier_ops or lora_loads))
        continuable = is_continuable_step(len(self.scheduled), is_run)
        num_steps = 1
        if is_run and self.scheduler.config.num_kv_ranks == 1:
            num_steps = self.num_run_steps if continuable else self.num_run_steps_through_last
        plan = StepPlan(step_id=step_id, seqs=self.scheduled, blocks_to_swap_out=self.blocks_to_swap_out,
                        blocks_to_swap_in=self.blocks_to_swap_in, blocks_to_copy=self.blocks_to_copy,
                        epoch=epoch, drafts_from_worker=self.drafts_from_worker, tier_ops=tier_ops,
                        masks_follow=bool(self.pending_masks), lora_loads=lora_loads, continuable=continuable,
                        num_steps=num_steps, streams_steps=num_steps > 1 and self.streams_steps,
                        end_token_ids=sorted(set().union(*(group.stop_token_ids for group in self.groups)))
                        if is_run else [])
        return ScheduledStep(plan=plan, sampled=self.sampled, groups=self.groups,
                             num_prefill_tokens=self.num_prefill_tokens,
                             num_decode_tokens=self.num_decode_tokens, num_preemptions=self.num_preemptions,
                             num_draft_tokens=self.num_draft_tokens, pending_masks=self.pending_masks,
                             vocab_size=self.scheduler.grammars.vocab_size if self.pending_masks else 0)

    # -- pass 1: running groups ---------------------------------------------------------------
    def _schedule_running(self) -> None:
        running = self.scheduler.running
        gpu = self.block_manager.gpu_pool
        size = self.block_manager.block_size
        drafter = Drafter.for_step(self.scheduler)
        self.speculates = drafter is not None
        decode_tokens = [num_decode_tokens(group) for group in running]
        num_reserved = sum(decode_tokens)
        index = 0
        while index < len(running):
            group = running[index]
            num_reserved -= decode_tokens[index]
            if not self.adapter_slots.acquire(group):
                index += 1  # its adapter has no slot in this step: it keeps its blocks and waits
                continue
            seqs = group.seqs
            is_drafting = drafter is not None and drafter.add_drafts(group, self.num_tokens_left - num_reserved)
            if not is_drafting and len(seqs) == 1 and group.fork_at is None and self.num_seqs_left > 0:
                seq = seqs[0]  # fast path: one sequence decoding in place, the common case
                computed = seq.num_computed_tokens
                if len(seq.token_ids) - computed == 1 and self.num_tokens_left > num_reserved:
                    if computed // size == len(seq.block_table):  # its slot starts a block not held yet
                        if gpu.num_available:
                            seq.block_table.append(gpu.allocate())
                            self._emit_decode(group, seq)
                            index += 1
                            continue
                    elif gpu.ref_counts[seq.block_table[computed // size]] == 1:  # or a block held ahead
                        self._emit_decode(group, seq)
                        index += 1
                        continue
            chunks = plan_chunks(group, self.num_tokens_left - num_reserved, self.num_seqs_left)
            while is_drafting and drop_unscheduled_drafts(group, chunks):
                chunks = plan_chunks(group, self.num_tokens_left - num_reserved, self.num_seqs_left)
            if is_drafting and gpu.num_available < self.block_manager.count_blocks_needed(
                    ((chunk.seq, chunk.num_tokens) for chunk in chunks), gpu):
                drop_group_drafts(group)  # proposals never preempt anyone
                chunks = plan_chunks(group, self.num_tokens_left - num_reserved, self.num_seqs_left)
            if chunks:
                num_needed = self.block_manager.count_blocks_needed(
                    ((chunk.seq, chunk.num_tokens) for chunk in chunks), gpu)
                while gpu.num_available < num_needed:
                    victim = choose_victim(running)
                    if victim is group:
                        drop_group_drafts(group)  # preemption keeps token_ids: no proposal may stay
                    self._preempt(victim)
                    if victim is group:
                        return
                    num_reserved -= decode_tokens.pop()
                self._emit(group, chunks)
            index += 1

    def _emit_decode(self, group: SequenceGroup, seq: Sequence) -> None:
        """A decode whose slot is in a block the sequence owns alone (no copy-on-write)."""
        computed = seq.num_computed_tokens
        seq.num_computed_tokens = computed + 1
        spec = seq.sample_spec
        if spec is None or not group.is_sample_spec_static:
            spec = sample_spec_for(group, seq)
        self.sampled.append((group, seq))
        size = self.block_manager.block_size
        if seq.matcher is None:
            self._take_block_ahead(group, seq, spec, computed)
        scheduled = ScheduledSeq(seq.seq_id, seq.token_ids[-1:], computed, seq.block_table[:], spec,
                                 lora_slot=self.adapter_slots.slot_of(group))
        if seq.matcher is not None:
            self._masks(scheduled, seq)
        elif is_predictable_decode(group, seq, spec, computed + 1, size):
            self.num_continuable += 1
            self.num_run_steps = min(self.num_run_steps, run_length(group, seq, computed, size, False))
            self.num_run_steps_through_last = min(self.num_run_steps_through_last,
                                                  run_length(group, seq, computed, size, True))
            self.streams_steps |= not group.request.hold_output
        self.scheduled.append(scheduled)
        if (computed + 1) % size == 0:
            self.emitted.append((group, seq))  # its last block is full now: register it
        self.groups.append(group)
        self.num_decode_tokens += 1
        self.num_tokens_left -= 1
        self.num_seqs_left -= 1

    def _take_block_ahead(self, group: SequenceGroup, seq: Sequence, spec, position: int) -> None:
        """The sequence's next block in this plan, when a decode run would go further with it and
        nothing waits for the pool (continuable.py: blocks ahead)."""
        gpu = self.block_manager.gpu_pool
        if (self.scheduler.config.num_kv_ranks == 1  # several ranks have no runs
                and not self.speculates and not self.scheduler.waiting and not self.scheduler.swapped
                and len(self.scheduler.running) <= MAX_RUN_SEQS
                and has_static_decode_spec(group, spec)
                and wants_block_ahead(group, seq, position, self.block_manager.block_size)
                and gpu.num_available > len(self.scheduler.running)):
            seq.block_table.append(gpu.allocate())

    def _masks(self, scheduled: ScheduledSeq, seq: Sequence) -> None:
        """The bitmask rows of a constrained sampling sequence: now, or after the plan is sent."""
        if self.defer_masks:
            scheduled.num_mask_rows = seq.num_draft_tokens + 1
            self.pending_masks.append((scheduled, seq))
        else:
            fill_masks(scheduled, seq, self.scheduler.grammars.vocab_size)

    def _preempt(self, group: SequenceGroup) -> None:
        preempt(self.scheduler, group, self.blocks_to_swap_out)
        self.num_preemptions += 1

    # -- pass 2: swapped groups -------------------------------------------------------------
    def _swap_in(self, num_free_slots: int) -> int:
        swapped = self.scheduler.swapped
        while swapped:
            group = swapped[0]
            if not self._try_swap_in(group, num_free_slots):
                break
            num_free_slots -= group.max_num_running_seqs
        return num_free_slots

    def _try_swap_in(self, group: SequenceGroup, num_free_slots: int) -> bool:
        """Swaps swapped[0] (group) back in and schedules it when it fits; False otherwise."""
        manager = self.block_manager
        if group.max_num_running_seqs > num_free_slots:
            return False
        chunks = plan_chunks(group, self.num_tokens_left, self.num_seqs_left)
        if not chunks:
            return False
        num_needed = manager.num_distinct_blocks(group.seqs) + manager.count_blocks_needed(
            ((chunk.seq, chunk.num_tokens) for chunk in chunks), manager.cpu_pool)
        if num_needed > manager.gpu_pool.num_available or not self.adapter_slots.can_acquire(group):
            return False
        self.adapter_slots.acquire(group)
        self.blocks_to_swap_in.extend(manager.swap_in(group.seqs))
        self.scheduler.swapped.remove(group)
        self._start_running(group)
        self._emit(group, chunks)
        return True

    # -- pass 3: waiting groups -------------------------------------------------------------
    def _admit_waiting(self, num_free_slots: int) -> None:
        waiting = self.scheduler.waiting
        while waiting and self.num_tokens_left > 0:
            group = waiting[0]
            if not self._try_admit(group, num_free_slots):
                break
            num_free_slots -= group.max_num_running_seqs

    def _try_admit(self, group: SequenceGroup, num_free_slots: int) -> bool:
        """Admits waiting[0] (group) and schedules its first chunk when it fits; False otherwise."""
        manager = self.block_manager
        prefix_cache = manager.prefix_cache
        isolated = self.scheduler.isolated_request_ids
        if group.max_num_running_seqs > num_free_slots:
            return False
        if isolated and group.request_id in isolated and any(
                other.request_id in isolated for other in self.groups):
            return False  # one suspect of a worker crash per step (see Scheduler.isolated_request_ids)
        if not self.adapter_slots.can_acquire(group):
            return False  # its adapter waits for a slot, and so does everyone behind it
        leader = group.seqs[0]
        limit = min(group.prefill_target(leader), len(leader.token_ids) - 1)
        num_queries, cached_blocks = prefix_cache.find_prefix(leader, limit)
        tiers = manager.tiers
        lookup = None
        if tiers is not None and len(cached_blocks) < num_queries:
            lookup = tiers.find(prefix_cache.keys_of(leader, num_queries)[len(cached_blocks):num_queries])
            if lookup.disk and not group.has_waited_for_disk and tiers.fetch(lookup.disk):
                group.has_waited_for_disk = True  # once per admission: a tiny host tier cannot loop
                return False  # waits a step for its blocks to come from disk (kv_tiers.py)
        manager.adopt_prefix(leader, cached_blocks)
        num_tier_hits = 0
        if lookup is not None and lookup.host:
            num_loads = min(tiers.num_affordable_loads(len(lookup.host), self.num_tokens_left),
                            manager.gpu_pool.num_available)
            hits = lookup.host[:num_loads]
            tiers.pin(hits)
            manager.adopt_tier_hits(leader, hits)
            self.num_tokens_left -= tiers.load_cost(len(hits))
            num_tier_hits = len(hits)
        manager.fork_if_ready(group)
        chunks = plan_chunks(group, self.num_tokens_left, self.num_seqs_left)
        num_needed = manager.count_blocks_needed(
            ((chunk.seq, chunk.num_tokens) for chunk in chunks), manager.gpu_pool)
        if not chunks or num_needed > manager.gpu_pool.num_available:
            manager.drop_kv(group)
            return False
        self.adapter_slots.acquire(group)
        num_hits = len(cached_blocks) + num_tier_hits  # every tier's hits count as cached
        prefix_cache.record(num_queries, num_hits)
        if tiers is not None:
            tiers.stats.hits["device"] += len(cached_blocks)
        group.has_waited_for_disk = False
        if not group.is_admitted_once:
            group.is_admitted_once = True
            # a continuation's leader may hit blocks past the prompt: those are not prompt tokens
            group.num_cached_prompt_tokens = min(num_hits * manager.block_size, group.num_prompt_tokens)
        self.scheduler.waiting.remove(group)
        self._start_running(group)
        self._emit(group, chunks)
        return True

    # -- shared -----------------------------------------------------------------------------
    def _start_running(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.RUNNING
        insort(self.scheduler.running, group, key=_arrival)

    def _emit(self, group: SequenceGroup, chunks: list[Chunk]) -> None:
        manager = self.block_manager
        copies = self.blocks_to_copy
        scheduled = self.scheduled
        for chunk in chunks:
            seq = chunk.seq
            num_tokens = chunk.num_tokens
            manager.append_slots(seq, num_tokens, copies)
            start = seq.num_computed_tokens
            seq.num_computed_tokens = start + num_tokens
            self.emitted.append((group, seq))
            spec = None
            if chunk.is_sampling:
                spec = sample_spec_for(group, seq)
                self.sampled.append((group, seq))
            scheduled_seq = ScheduledSeq(seq.seq_id, seq.token_ids[start:start + num_tokens], start,
                                         list(seq.block_table), spec, seq.num_draft_tokens,
                                         lora_slot=self.adapter_slots.slot_of(group))
            if chunk.is_sampling and seq.matcher is not None:
                self._masks(scheduled_seq, seq)
            scheduled.append(scheduled_seq)
            if seq.num_draft_tokens:
                if self.drafts_from_worker:  # start is the position of the last real token
                    scheduled_seq.draft_context_ids = seq.token_ids[seq.num_draft_computed:start]
                    scheduled_seq.draft_start_position = seq.num_draft_computed
                self.num_decode_tokens += 1
                self.num_draft_tokens += seq.num_draft_tokens
            elif num_tokens == 1:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += num_tokens
            self.num_tokens_left -= num_tokens
            self.num_seqs_left -= 1
        self.groups.append(group)


def _arrival(group: SequenceGroup) -> tuple[int, int]:
    return group.queue_key
