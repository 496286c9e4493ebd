"""The scheduler core: requests in, one StepPlan per step out, sampled tokens back in.

Single-threaded. A step alternates strictly: schedule() -> the workers run the plan ->
process_result(). Requests may be added, aborted or finished between any two calls; what they
change joins at the next schedule(). Block operations of a plan run on the workers before its
forward, in the order swap out, swap in, copy; blocks freed while a step runs are only reused by
later steps, which the workers run after it.
"""

from __future__ import annotations

from bisect import insort
from typing import TYPE_CHECKING

from pagedserve.contracts.request_types import CompletionDelta, FinishReason, Request, RequestOutput
from pagedserve.scheduler.kv.block_manager import BlockManager
from pagedserve.scheduler.core.errors import RequestFailure, RequestRejected, StepOrderError
from pagedserve.scheduler.core.invariants import check_scheduler_invariants
from pagedserve.scheduler.core.output_processor import OutputProcessor
from pagedserve.scheduler.core.request_intake import build_group
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.stats import PoolStats, SchedulerStats, TierTotals
from pagedserve.scheduler.core.sequence import GroupStatus, Sequence, SequenceGroup
from pagedserve.scheduler.speculation.acceptance import SpecDecodeStats
from pagedserve.scheduler.core.scheduled_step import ScheduledStep
from pagedserve.scheduler.core.step_builder import StepBuilder
from pagedserve.contracts.step_plan import StepResult
from pagedserve.scheduler.structured_output.sequences import attach_matchers
from pagedserve.scheduler.lora.slot_table import LoraSlotTable

if TYPE_CHECKING:
    from pagedserve.scheduler.structured_output.compiler import GrammarCompiler


class Scheduler:
    def __init__(self, config: SchedulerConfig, grammars: GrammarCompiler | None = None) -> None:
        """grammars compiles structured-output constraints (None: constrained requests are refused)."""
        config.check_complete()
        self.config = config
        self.grammars = grammars
        self.block_manager = BlockManager(config)
        self.waiting: list[SequenceGroup] = []  # each queue ordered by queue_key: (priority, arrival)
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._groups: dict[str, SequenceGroup] = {}
        self._outputs = OutputProcessor(self)
        self._pending_outputs: list[RequestOutput] = []
        self._failures: list[RequestFailure] = []
        # Requests that were in flight when the workers crashed: at most one of them joins a
        # step, so a request that crashes the workers again does not take the others with it.
        self.isolated_request_ids: set[str] = set()
        self._in_flight: ScheduledStep | None = None
        self._next_seq_id = 0
        self._next_arrival = 0
        self._next_step_id = 1
        self.epoch = 0
        self.num_steps = 0
        self.num_preemptions_swap = 0
        self.num_preemptions_recompute = 0
        self.spec_stats = SpecDecodeStats()
        self.lora_slots = LoraSlotTable(config.max_loras) if config.enable_lora else None

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request; raises RequestRejected when it could never be served."""
        if request.request_id in self._groups:
            raise RequestRejected(request.request_id, "a request with this id is already running")
        group = build_group(request, self.config, arrival_index=self._next_arrival,
                            next_seq_id=self.new_seq_id)
        attach_matchers(group, self.grammars)
        self._next_arrival += 1
        if self.config.is_speculating and (request.sampling.is_beam_search or (
                request.sampling.is_constrained and self.config.is_draft_model_speculation)):
            self.spec_stats.num_beam_search_requests += 1  # served exactly, without proposals
        self._groups[request.request_id] = group
        insort(self.waiting, group, key=_queue_key)  # fcfs: priority 0, so this appends

    def abort_request(self, request_id: str) -> bool:
        """Drops a request and frees its blocks now; False when it is unknown or already done."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            seq.finish_reason = FinishReason.ABORT
        self.finish_group(group)
        self._pending_outputs = [out for out in self._pending_outputs if out.request_id != request_id]
        return True

    def fail_group(self, group: SequenceGroup, message: str) -> None:
        """Drops a request whose step could not be handled (its sampling or output processing
        raised): its blocks are freed now and pop_failures() reports it, once."""
        if self._groups.get(group.request_id) is not group:
            return
        self.abort_request(group.request_id)
        self._failures.append(RequestFailure(group.request_id, message))

    def pop_failures(self) -> list[RequestFailure]:
        failures, self._failures = self._failures, []
        return failures

    def finish_completion(self, request_id: str, index: int) -> bool:
        """Ends one completion (a stop string matched in the frontend) and frees its blocks.

        Its final delta (finish_reason ABORT, no tokens) and, when it was the last one, the
        request's finished output come with the next process_result() or pop_pending_outputs().
        Beam search completions exist only once the search ended: False for those.
        """
        group = self._groups.get(request_id)
        if group is None or group.beam is not None:
            return False
        seq = next((seq for seq in group.seqs if seq.output_index == index), None)
        if seq is None:
            return False
        self.block_manager.hand_over_before_fork(group, seq)
        self.finish_seq(group, seq, FinishReason.ABORT)
        if len(group.seqs) < 2:
            group.fork_at = None
        is_finished = not group.seqs
        if is_finished:
            self.finish_group(group)
        self._pending_outputs.append(RequestOutput(
            request_id=request_id,
            deltas=[CompletionDelta(index=index, token_ids=[], cumulative_logprob=seq.cumulative_logprob,
                                    finish_reason=FinishReason.ABORT)],
            prompt_tokens=group.num_prompt_tokens,
            cached_prompt_tokens=group.num_cached_prompt_tokens, is_finished=is_finished))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def pop_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside a step (finish_completion); process_result() includes them."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    # -- steps --------------------------------------------------------------------------------
    def schedule(self, defer_masks: bool = False) -> ScheduledStep | None:
        """The next step, or None when nothing can run now. defer_masks: constrained sequences'
        bitmask rows are left for ScheduledStep.fill_masks() (after the plan is published)."""
        if self._in_flight is not None:
            raise StepOrderError(f"step {self._in_flight.plan.step_id} has not been processed yet")
        step = StepBuilder(self, defer_masks).build(self._next_step_id, self.epoch)
        if step is not None:
            self._next_step_id += 1
            self.num_steps += 1
            self._in_flight = step
        return step

    def process_result(self, step: ScheduledStep, result: StepResult) -> list[RequestOutput]:
        """Applies the workers' answer to step; results of steps from before reset() are ignored.
        After the steps of a run that streamed them (process_run_step), the answer is the result
        that ends the run; a run's steps may also come in one result, streamed or not."""
        if not self._is_in_flight(step, result):
            return []
        self._in_flight = None
        if self.block_manager.tiers is not None:
            self.block_manager.tiers.complete(step.plan, result)
        if step.num_streamed_steps:
            if result.run_step or result.samples or result.num_steps != step.num_streamed_steps:
                raise StepOrderError(f"step {result.step_id}: a run of {step.num_streamed_steps} streamed steps "
                                     f"ended by a result of {result.num_steps} with {len(result.samples)} samples")
            return self.pop_pending_outputs()
        return self.pop_pending_outputs() + self._outputs.process(step, result)

    def process_run_step(self, step: ScheduledStep, result: StepResult) -> list[RequestOutput]:
        """Applies one step of a run that streams its steps (StepPlan.streams_steps) as it comes;
        the run stays in flight until the result that ends it (process_result)."""
        if not self._is_in_flight(step, result):
            return []
        if not step.plan.streams_steps or not result.run_step:
            raise StepOrderError(f"step {result.step_id}: a streamed step of a plan that does not stream its steps")
        return self.pop_pending_outputs() + self._outputs.process_run_step(step, result)

    def _is_in_flight(self, step: ScheduledStep, result: StepResult) -> bool:
        """Whether result answers the step in flight (False: a step from before reset())."""
        if step is not self._in_flight:
            if step.plan.epoch != self.epoch:
                return False
            raise StepOrderError(f"step {step.plan.step_id} is not the step in flight")
        if result.step_id != step.plan.step_id:
            raise StepOrderError(f"result of step {result.step_id} given for step {step.plan.step_id}")
        return True

    def reset(self) -> None:
        """Workers restarted and every KV block is lost: all unfinished requests wait to be
        computed again from the tokens they hold, in queue order (priority, arrival). Step ids keep counting; the
        plan epoch increases."""
        self.block_manager.gpu_pool.reset()
        self.block_manager.cpu_pool.reset()
        if self.block_manager.tiers is not None:
            self.block_manager.tiers.reset()
        groups = sorted(self.running + self.swapped + self.waiting, key=_queue_key)
        for group in groups:
            for seq in group.seqs:
                seq.drop_drafts()  # a step in flight was lost with its proposals
                seq.reset_computation()
            group.plan_shared_prefix()
            group.status = GroupStatus.WAITING
        self.waiting, self.running, self.swapped = groups, [], []
        self._in_flight = None
        if self.lora_slots is not None:
            self.lora_slots.reset()  # the new workers' slots are empty
        self.epoch += 1

    # -- group and sequence transitions (used by StepBuilder and OutputProcessor) -------------
    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def finish_seq(self, group: SequenceGroup, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.block_manager.free(seq, on_cpu=group.status is GroupStatus.SWAPPED)
        group.seqs.remove(seq)
        group.num_completions_done += 1

    def finish_group(self, group: SequenceGroup) -> None:
        """Frees what the group still holds and forgets it."""
        on_cpu = group.status is GroupStatus.SWAPPED
        for seq in group.seqs:
            self.block_manager.free(seq, on_cpu=on_cpu)
        queue = {GroupStatus.RUNNING: self.running, GroupStatus.SWAPPED: self.swapped,
                 GroupStatus.WAITING: self.waiting}.get(group.status)
        if queue is not None:
            queue.remove(group)
        group.status = GroupStatus.FINISHED
        del self._groups[group.request_id]

    # -- inspection ---------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        prefix_cache = self.block_manager.prefix_cache
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            num_running_seqs=sum(len(group.seqs) for group in self.running),
            gpu=PoolStats.of(self.block_manager.gpu_pool), cpu=PoolStats.of(self.block_manager.cpu_pool),
            num_steps=self.num_steps, num_preemptions_swap=self.num_preemptions_swap,
            num_preemptions_recompute=self.num_preemptions_recompute,
            num_prefix_cache_queries=prefix_cache.num_queries, num_prefix_cache_hits=prefix_cache.num_hits,
            num_spec_drafts=self.spec_stats.num_drafts, num_spec_draft_tokens=self.spec_stats.num_draft_tokens,
            num_spec_accepted_tokens=self.spec_stats.num_accepted_tokens,
            num_spec_accepted_per_position=tuple(self.spec_stats.num_accepted_per_position),
            num_spec_unspeculated_requests=self.spec_stats.num_beam_search_requests,
            tiers=TierTotals.of(self.block_manager.tiers),

            num_lora_loads=self.lora_slots.num_loads if self.lora_slots is not None else 0,
            num_lora_evictions=self.lora_slots.num_evictions if self.lora_slots is not None else 0)

    def check_invariants(self) -> None:
        """Raises InvariantError when block accounting or queues are inconsistent."""
        check_scheduler_invariants(self)

    @property
    def is_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def group_of(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def num_blocks_of_request(self, request_id: str) -> int:
        """Distinct physical blocks the request holds now (shared blocks counted once)."""
        group = self._groups.get(request_id)
        return 0 if group is None else self.block_manager.num_distinct_blocks(group.seqs)


def _queue_key(group: SequenceGroup) -> tuple[int, int]:
    return group.queue_key
