"""The steps of a decode, one position after another, with their inputs kept between steps.

A step whose sequences all decode one token is, unless a token ends a sequence or a request
arrives, followed by the same decodes one position on: the steps of a decode run and those
computed ahead of their plans (worker/continuation.py), the plans of streamed decodes, a batch
decoding between arrivals. ModelRunner.execute hands every plan that qualifies to the DecodeRun it
keeps:

    every sequence   decodes one token and samples it plain greedily (no penalties, suppressed
                     tokens, logprobs beyond the chosen token's, beams or logit_bias: the
                     sampler's _sample_greedy path), with no drafts, masks or adapter
    the plan         no block, tier or adapter operations, no drafts from the worker, no masks
    the worker       one rank, no LoRA, and a model whose step of these rows takes the native
                     decode step with the embedding and final norm (NativeDecodeRun: up to 4
                     rows, or 32 where every projection is in panels or GGUF blocks)

The run is kept while the plans keep its sequences in the same order with the same specs; a
sequence whose block table gained blocks at its end keeps its row (the new blocks written into
the kept table). Another plan that qualifies starts another run (a request arrived or finished),
one that does not goes through the full step. A step writes each row's token, position, slot and
length into the kept input, makes the native call for the whole model, the LM head's call and the
greedy kernel's, picked once per run, and wraps the samples: the kernels and the order of the
full step, so the same tokens and log probabilities (tests/worker/test_decode_run.py), for a
fraction of its Python and allocations.

The later steps of a decode run (continuation.py run_steps) need no plan each: steps_after hands
the worker a call that feeds each row the token it just sampled one position on: the inputs of
the plan next_plan would derive, without building that plan, checking it (accepts) and wrapping
its result here. Where the native library makes the run's calls (its LM head in panels, rows or
GGUF blocks), the call's `many` computes up to all of a run's later steps in one native call
(kernels/layer/decode_run.py): the same calls in the same order, without the Python between the
steps, which runs with the CPU caches just flushed by the weights.
"""

from __future__ import annotations

import time

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, SeqSample, StepPlan, StepResult
from pagedserve.kernels import ops
from pagedserve.worker.models.llama_native import NativeDecodeRun
from pagedserve.worker.sampler import is_plain_greedy


def _qualifies(plan: StepPlan) -> bool:
    return (bool(plan.seqs)
            and not (plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.blocks_to_copy or plan.lora_loads
                     or plan.drafts_from_worker or plan.masks_follow)
            and (plan.tier_ops is None or plan.tier_ops.is_empty))


def _decodes_one_token(seq: ScheduledSeq) -> bool:
    return len(seq.token_ids) == 1 and not seq.num_draft_tokens and not seq.num_mask_rows and seq.lora_slot < 0


def _is_plain_decode(seq: ScheduledSeq) -> bool:
    spec = seq.sample
    return _decodes_one_token(seq) and spec is not None and is_plain_greedy(spec) and not spec.logit_bias


class DecodeRun:
    """Plans of the same one-token greedy decodes (module doc) through a NativeDecodeRun."""

    def __init__(self, native: NativeDecodeRun, kv_caches: list, seqs: list[ScheduledSeq]) -> None:
        self.native = native
        self.kv_caches = kv_caches
        self.seq_ids = [seq.seq_id for seq in seqs]
        self.specs: list[SampleSpec] = [seq.sample for seq in seqs]
        self.tables = native.tables
        self._greedy = ops.bound_greedy(native.logits) if native.logits is not None else None
        self._steps = native.bind_steps(self._greedy) if self._greedy is not None else None
        self._positions: list[int] = []  # of the last step computed
        self._last_result: StepResult | None = None  # of the last step computed through a plan

    @classmethod
    def for_plan(cls, model, kv_caches: list, plan: StepPlan, block_size: int) -> "DecodeRun | None":
        """A run for plan's sequences, or None when plan or model does not qualify (module doc)."""
        if not (_qualifies(plan) and all(map(_is_plain_decode, plan.seqs))):
            return None
        native = NativeDecodeRun.for_rows(model, kv_caches, [seq.block_table for seq in plan.seqs], block_size)
        return cls(native, kv_caches, plan.seqs) if native is not None else None

    def accepts(self, plan: StepPlan, kv_caches: list) -> bool:
        """Whether plan is a step of this run's sequences (module doc) over the same caches; a
        sequence whose table gained blocks at its end keeps its row, the new blocks written in."""
        if kv_caches is not self.kv_caches or len(plan.seqs) != len(self.seq_ids) or not _qualifies(plan):
            return False
        grown = []
        for row, (seq, seq_id, spec, table) in enumerate(zip(plan.seqs, self.seq_ids, self.specs, self.tables)):
            if not (seq.seq_id == seq_id and (seq.sample is spec or seq.sample == spec) and _decodes_one_token(seq)):
                return False
            new = seq.block_table
            if new != table:
                if not self.native.can_grow(row, new, kv_caches[0][0].shape[0]):
                    return False
                grown.append((row, new))
        for row, new in grown:
            self.native.grow(row, new)
        return True

    def __call__(self, plan: StepPlan) -> StepResult | None:
        """plan's result (the caller checked accepts), or None when a position is outside its
        sequence's blocks or the rotary table (the full step then reports it)."""
        seqs = plan.seqs
        positions = [seq.start_position for seq in seqs]
        self._last_result = None
        computed = self._step([seq.token_ids[0] for seq in seqs], positions)
        if computed is None:
            return None
        ids, logprobs, forward_seconds = computed
        samples = [SeqSample(seq_id=seq_id, token_id=token_id, logprob=logprob)
                   for seq_id, token_id, logprob in zip(self.seq_ids, ids, logprobs)]
        result = StepResult(step_id=plan.step_id, samples=samples, forward_seconds=forward_seconds, epoch=plan.epoch)
        self._last_result = result
        return result

    def steps_after(self, result: StepResult) -> "LaterSteps | None":
        """Where `result` is the last step this run computed (through a plan), the steps after it
        (LaterSteps); None where result is not this run's last."""
        return LaterSteps(self) if result is not None and result is self._last_result else None

    def _many(self, token_ids: list[int], num_steps: int, end_token_ids: list[int],
              poll: tuple[int, int] | None = None) -> tuple[list[int], list[float], list[float]]:
        self._last_result = None
        ids, logprobs, forward_seconds = self._steps.run(token_ids, num_steps, end_token_ids, poll)
        count = len(ids) // len(self.seq_ids)
        self._positions = [position + count for position in self._positions]
        return ids, logprobs, forward_seconds

    def _next_step(self, token_ids: list[int]) -> tuple[list[int], list[float], float] | None:
        self._last_result = None
        return self._step(token_ids, [position + 1 for position in self._positions])

    def _step(self, token_ids: list[int], positions: list[int]) -> tuple[list[int], list[float], float] | None:
        if not self.native.set_rows(token_ids, positions):
            return None
        self._positions = positions
        started = time.perf_counter()
        logits = self.native.step()
        forward_seconds = time.perf_counter() - started
        ids, logprobs = self._greedy() if self._greedy is not None else ops.greedy(logits)
        return ids, logprobs, forward_seconds


class LaterSteps:
    """The steps of a decode run after the one it computed last (DecodeRun.steps_after).

    Called with the token each row feeds (in the plan's order): the next step's (token ids, log
    probabilities, forward seconds), one position on from the step before; or None from a step
    whose position would be outside a sequence's blocks or the rotary table (nothing computed).

    many (None where the native loop does not make the run's calls): many(token_ids, num_steps,
    end_token_ids, poll) computes up to num_steps such steps in one native call, the first feeding
    token_ids and each later one the tokens the one before sampled; it stops before a step that
    would feed one of end_token_ids, when poll (a zmq_poll function's address and a poll item's,
    or None) finds a message waiting, or where the call above would compute nothing. It gives
    every step's ids and log probabilities, row after row and step after step, and each step's
    forward seconds."""

    def __init__(self, run: DecodeRun) -> None:
        self._run = run
        self.many = run._many if run._steps is not None else None

    def __call__(self, token_ids: list[int]) -> tuple[list[int], list[float], float] | None:
        return self._run._next_step(token_ids)
