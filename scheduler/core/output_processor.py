"""Applies a StepResult: appends sampled tokens, applies stops, advances beam searches (scored in
beam_search.py, forked in beam_forking.py), forks followers whose shared prefix is now computed,
and reports deltas. A sequence that verified speculative drafts gets several tokens at once
(spec_acceptance.py).

A decode run (StepPlan.num_steps > 1, continuable.py) answers several steps in one result: they
are applied in order, as the steps they are (each sequence's KV one position on before its next
token, its block registered once full), and each request gets one delta with all its tokens. A run
that streams its steps (StepPlan.streams_steps) answers each step as it comes (process_run_step):
its first like a step of its own, each later one as that step of the run.

A constrained sequence's matcher consumes every token appended (structured_output/): the
worker's mask let only tokens the grammar accepts through, and EOS only once the value is
complete, so a finished grammar ends the sequence with STOP.

Stops, checked on the token just appended (it is part of the output, like HF's EOS):

    STOP    the token is a stop id (EOS unless ignore_eos, or stop_token_ids) and the sequence
            has more than min_tokens outputs (before that the worker suppresses them)
    LENGTH  max_tokens outputs (max_tokens <= max_model_len - prompt is checked on admission)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.contracts.request_types import CompletionDelta, FinishReason, RequestOutput, TokenLogprob
from pagedserve.scheduler.beam.forking import fork_beams
from pagedserve.scheduler.beam.search import BeamCandidate, BeamHypothesis
from pagedserve.scheduler.core.errors import StepOrderError
from pagedserve.scheduler.core.sequence import GroupStatus, Sequence, SequenceGroup
from pagedserve.scheduler.speculation.acceptance import apply_verified
from pagedserve.contracts.step_plan import SeqSample, StepResult
from pagedserve.scheduler.structured_output.sequences import consume_output

if TYPE_CHECKING:
    from pagedserve.scheduler.core.scheduler import Scheduler
    from pagedserve.scheduler.core.scheduled_step import ScheduledStep


class OutputProcessor:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def process(self, step: ScheduledStep, result: StepResult) -> list[RequestOutput]:
        """Outputs of the step's groups. A group whose sampling failed on the worker, or whose
        output handling raises here, fails alone (Scheduler.fail_group); the others go on."""
        if result.num_steps > 1:
            return self._process_run(step, result)
        samples = {sample.seq_id: sample for sample in result.samples}
        verified = samples_by_seq(result.samples) if step.num_draft_tokens else {}
        worker_failures = {failure.seq_id: failure.message for failure in result.failures}
        failed: dict[SequenceGroup, str] = {}
        deltas_of: dict[SequenceGroup, list[CompletionDelta]] = {}
        beam_samples: dict[SequenceGroup, list[SeqSample]] = {}
        running = GroupStatus.RUNNING
        for group, seq in step.sampled:
            if group.status is not running or seq.finish_reason is not None or group in failed:
                continue  # aborted or finished by the frontend while the step ran, or failed
            if seq.seq_id in worker_failures:
                failed[group] = worker_failures[seq.seq_id]
                continue
            sample = samples.get(seq.seq_id)
            if sample is None:
                raise StepOrderError(f"step {result.step_id}: no sample for sequence {seq.seq_id}")
            if group.beam is not None:
                beam_samples.setdefault(group, []).append(sample)
                continue
            try:
                if seq.num_draft_tokens:
                    delta = apply_verified(self, group, seq, verified[seq.seq_id],
                                           drafts_from_worker=step.plan.drafts_from_worker)
                else:
                    delta = self._append(group, seq, sample)
            except Exception as exc:
                failed[group] = f"handling the sampled token failed: {type(exc).__name__}: {exc}"
                continue
            deltas_of.setdefault(group, []).append(delta)
        for group, message in failed.items():
            deltas_of.pop(group, None)
            beam_samples.pop(group, None)
            self.scheduler.fail_group(group, message)
        for group in step.groups:
            if group.fork_at is not None and group.status is running:
                self.scheduler.block_manager.fork_if_ready(group)
        for group, group_samples in beam_samples.items():
            try:
                deltas = self._advance_beams(group, group_samples)
            except Exception as exc:
                self.scheduler.fail_group(group, f"beam search step failed: {type(exc).__name__}: {exc}")
                continue
            if deltas:
                deltas_of[group] = deltas
        return self._outputs(deltas_of)

    def _outputs(self, deltas_of: dict[SequenceGroup, list[CompletionDelta]]) -> list[RequestOutput]:
        outputs = []
        for group, deltas in deltas_of.items():
            is_finished = not group.seqs
            if is_finished:
                self.scheduler.finish_group(group)
            outputs.append(RequestOutput(group.request.request_id, deltas, group.num_prompt_tokens,
                                         group.num_cached_prompt_tokens, is_finished))
        return outputs

    def _process_run(self, step: ScheduledStep, result: StepResult) -> list[RequestOutput]:
        """The steps of a decode run (module doc); a group whose token handling raises fails alone."""
        num_seqs, num_steps = len(step.sampled), result.num_steps
        if num_steps > step.plan.num_steps or result.failures or len(result.samples) != num_seqs * num_steps:
            raise StepOrderError(f"step {result.step_id}: {len(result.samples)} samples and "
                                 f"{len(result.failures)} failures for {num_steps} steps of a run of "
                                 f"{step.plan.num_steps} over {num_seqs} sequences")
        deltas_of: dict[SequenceGroup, list[CompletionDelta]] = {}
        failed: dict[SequenceGroup, str] = {}
        for index in range(num_steps):
            self._apply_run_step(step, result.samples[index * num_seqs:(index + 1) * num_seqs], index,
                                 deltas_of, failed)
        return self._run_outputs(deltas_of, failed)

    def process_run_step(self, step: ScheduledStep, result: StepResult) -> list[RequestOutput]:
        """One step of a run that streams its steps (StepResult.run_step), in the run's order: the
        first as a step of its own, a later one as the run's step it is (module doc)."""
        index = result.run_step - 1
        if (index != step.num_streamed_steps or index >= step.plan.num_steps or result.num_steps != 1
                or (index and result.failures)):
            raise StepOrderError(f"step {result.step_id}: step {index} of a run of {step.plan.num_steps} "
                                 f"given after {step.num_streamed_steps}")
        step.num_streamed_steps += 1
        if not index:
            return self.process(step, result)
        if len(result.samples) != len(step.sampled):
            raise StepOrderError(f"step {result.step_id}: {len(result.samples)} samples for step {index} "
                                 f"of a run over {len(step.sampled)} sequences")
        deltas_of: dict[SequenceGroup, list[CompletionDelta]] = {}
        failed: dict[SequenceGroup, str] = {}
        self._apply_run_step(step, result.samples, index, deltas_of, failed)
        return self._run_outputs(deltas_of, failed)

    def _run_outputs(self, deltas_of: dict[SequenceGroup, list[CompletionDelta]],
                     failed: dict[SequenceGroup, str]) -> list[RequestOutput]:
        for group, message in failed.items():
            deltas_of.pop(group, None)
            self.scheduler.fail_group(group, message)
        return self._outputs(deltas_of)

    def _apply_run_step(self, step: ScheduledStep, step_samples: list[SeqSample], index: int,
                        deltas_of: dict[SequenceGroup, list[CompletionDelta]], failed: dict[SequenceGroup, str]) -> None:
        """Step `index` of a run: each live sequence's token appended, its delta joined to its
        request's (one delta per request)."""
        register = self.scheduler.block_manager.prefix_cache.register_computed
        block_size = self.scheduler.block_manager.block_size
        running = GroupStatus.RUNNING
        samples = {sample.seq_id: sample for sample in step_samples}
        for group, seq in step.sampled:
            if group.status is not running or seq.finish_reason is not None or group in failed:
                continue
            sample = samples.get(seq.seq_id)
            if sample is None:
                raise StepOrderError(f"step {step.plan.step_id}: no sample for sequence {seq.seq_id} "
                                     f"in step {index} of its run")
            if index:  # this step computed the KV of the token the step before sampled
                seq.num_computed_tokens += 1
                step.num_decode_tokens += 1
                if seq.num_computed_tokens % block_size == 0:
                    register(seq)
            try:
                delta = self._append(group, seq, sample)
            except Exception as exc:
                failed[group] = f"handling the sampled token failed: {type(exc).__name__}: {exc}"
                continue
            deltas = deltas_of.setdefault(group, [])
            if deltas:  # one delta per request: its tokens joined
                last = deltas[-1]
                last.token_ids += delta.token_ids
                last.logprobs += delta.logprobs
                last.cumulative_logprob, last.finish_reason = delta.cumulative_logprob, delta.finish_reason
            else:
                deltas.append(delta)

    def _append(self, group: SequenceGroup, seq: Sequence, sample: SeqSample) -> CompletionDelta:
        token_id = sample.token_id
        tokens = seq.token_ids
        if seq.matcher is not None:
            consume_output(seq, token_id)  # raises before the token is kept when the grammar refuses it
        tokens.append(token_id)
        cumulative_logprob = seq.cumulative_logprob = seq.cumulative_logprob + sample.logprob
        sampling = group.request.sampling
        logprobs = []
        if sampling.logprobs > 0:
            logprobs.append(TokenLogprob(token_id, sample.logprob, list(sample.top_token_ids),
                                         list(sample.top_logprobs)))
        num_outputs = len(tokens) - seq.num_prompt_tokens
        finish_reason = None
        if token_id in group.stop_token_ids and num_outputs > sampling.min_tokens:
            finish_reason = FinishReason.STOP
        elif num_outputs >= group.max_output_tokens:
            finish_reason = FinishReason.LENGTH
        if finish_reason is not None:
            self.scheduler.finish_seq(group, seq, finish_reason)
        return CompletionDelta(seq.output_index, [token_id], logprobs, cumulative_logprob, finish_reason)

    def _advance_beams(self, group: SequenceGroup, samples: list[SeqSample]) -> list[CompletionDelta]:
        """One beam search step over every live beam; deltas only when the search ends."""
        parents = group.seqs
        if len(samples) != len(parents):
            raise StepOrderError(f"request {group.request_id}: {len(samples)} of {len(parents)} beams sampled")
        state = group.beam
        is_logging = group.request.sampling.logprobs > 0

        def token_logprob(candidate: BeamCandidate) -> TokenLogprob:
            sample = samples[candidate.beam_index]
            return TokenLogprob(candidate.token_id, candidate.logprob, list(sample.top_token_ids),
                                list(sample.top_logprobs))

        def make_hypothesis(candidate: BeamCandidate, score: float) -> BeamHypothesis:
            parent = parents[candidate.beam_index]
            return BeamHypothesis(
                token_ids=parent.output_token_ids + [candidate.token_id],
                score=score,
                is_stopped_by_token=candidate.token_id in group.stop_token_ids,
                logprobs=parent.output_logprobs + [token_logprob(candidate)] if is_logging else [],
            )

        candidates = [list(zip(sample.beam_token_ids, sample.beam_logprobs)) for sample in samples]
        step = state.step(candidates, make_hypothesis)
        group.seqs = fork_beams(parents, step.continuations, self.scheduler.block_manager,
                                self.scheduler.new_seq_id, token_logprob if is_logging else None)
        if not step.is_done:
            return []
        return [CompletionDelta(index=index, token_ids=hypothesis.token_ids, logprobs=hypothesis.logprobs,
                                cumulative_logprob=hypothesis.score,
                                finish_reason=FinishReason.STOP if hypothesis.is_stopped_by_token
                                else FinishReason.LENGTH)
                for index, hypothesis in enumerate(state.finished)]


def samples_by_seq(samples: list[SeqSample]) -> dict[int, list[SeqSample]]:
    """A drafting sequence has one sample per emitted token, in order."""
    by_seq: dict[int, list[SeqSample]] = {}
    for sample in samples:
        by_seq.setdefault(sample.seq_id, []).append(sample)
    return by_seq
