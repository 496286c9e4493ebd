"""When a step is a decode run or continuable: the worker computes the steps after it itself,
because each is, unless a token ends a sequence, the same decodes one position on.

    a sequence   decodes one sampled token in a block it owns alone (StepBuilder._emit_decode), the
                 next position lies in the blocks it holds, its spec changes with neither tokens
                 nor positions (no penalties, no min_tokens window, no beams; structured output is
                 ruled out by the builder), and it has more tokens to go after this one
    a run step   every sequence so, at most MAX_RUN_SEQS of them; no speculation, nothing
                 waiting or swapped out, and no block operations, KV tier operations or adapter
                 loads
    continuable  a run step of at most MAX_CONTINUABLE_SEQS sequences

A run step is a decode run (StepPlan.num_steps > 1) on a single-rank worker: the worker computes
its steps in a row, each one position on, so the scheduler plans, sends and receives one plan for
up to MAX_RUN_STEPS tokens of each sequence instead of one per token, and the worker does not wait
for a plan between them. When the run's requests all take their whole answer at the end
(Request.hold_output: nobody reads their tokens one by one), the worker answers every step in one
result, applied once. When some read tokens as they come (StepPlan.streams_steps), it sends each
step's result as soon as it is computed and the scheduler applies it and hands its tokens out at
once, then a result that ends the run: a token leaves the worker when it would without runs, and
the scheduler and the worker skip the plan of every step but the first (the scheduler's step
turned around on the same cores as the forward). A run stays inside the blocks the plan gives;
a continuable one also stops short of every sequence's last token, a run that is not continuable
may end with one (run_length). A run step names the tokens that may end its
sequences (StepPlan.end_token_ids: EOS unless ignored, stop tokens); the worker ends a run after a
step that sampled one, and the scheduler plans whatever follows (a sequence the token did not end
goes on in the next plan).

A continuable plan (StepPlan.continuable) also lets the worker compute, before the next plan
arrives, the step after its last one (worker/continuation.py): used when the plan confirms it, a
whole forward the next plan waits for when it does not.

Blocks ahead: a predictable decode whose held blocks leave no more than MAX_RUN_STEPS positions
(a run and the step computed after it), and fewer than its answer has to go, gets its next block
in the same plan (wants_block_ahead), when nothing waits and the pool keeps a free block for every
running group besides. Runs then cross block boundaries instead of ending at each sequence's block
end (with 32 sequences one crosses nearly every step), and, with blocks of MAX_RUN_STEPS
positions or more (the default 16), a run that fills its blocks to their end still has its step
after it computed ahead. The block is the sequence's alone and is used
within MAX_RUN_STEPS + 1 steps, or freed with the sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.contracts.step_plan import SampleSpec

if TYPE_CHECKING:
    from pagedserve.scheduler.core.scheduler import Scheduler
    from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup

# At most this many sequences in a continuable step. A step computed ahead saves the worker the
# turn-around between steps (about 1.5 ms through `serve` on a 2-core Zen 4) and costs a whole
# forward when the next plan differs (a request finished by a stop token, a new one arrived). The
# forward grows with the batch while the turn-around does not, and so do finishes and arrivals:
# at one stream of SmolLM2 the gain is about a fifth of the step, at eight the misses cost more.
MAX_CONTINUABLE_SEQS = 4

# At most this many sequences in a decode run: the rows of the worker's native decode step
# (worker/decode_run.py). A run wastes nothing when the batch changes (an arrival ends it after its
# current step, a stop token after the step that sampled it), so it is not bound by the misses
# that bound a step computed ahead. In a run that streams its steps the scheduler and the frontend
# handle each step's tokens while the worker computes the next, on the same cores: at 32 streamed
# requests on a 2-core Zen 4 that gave the same tokens/s as a plan per step (0.93-1.03x in seven
# pairs, bench/real_model.py) with a third of the plans and less of the step at its edges.
MAX_RUN_SEQS = 32

# At most this many steps in a decode run: the scheduler's cost per token falls as 1 / steps. A
# request that arrives (or is cancelled) during a run ends it after its current step (EndRun,
# scheduler/worker_link.py), so its prefill waits for one step, as it would without runs; the cap
# bounds what a lost EndRun could cost (16 steps of SmolLM2 at one stream on a 2-core CPU:
# 100-180 ms) and the steps a stop string found by the scheduler leaves computed for nothing. With
# a run's later steps in one native call (worker/decode_run.py), what a token still pays at its
# edges is mostly per plan: at one stream on a 2-core AMD EPYC runs of 16 spent 1.3-2.3 % of the
# steps' time outside the forwards where runs of 8 spent 1.8-3.8 % (four alternated pairs each in
# bfloat16 and with Q4_1 blocks, through `serve`).
MAX_RUN_STEPS = 16


def is_predictable_decode(group: SequenceGroup, seq: Sequence, spec: SampleSpec, next_position: int,
                          block_size: int) -> bool:
    """Whether the step after this decode is, unless the token ends the sequence, the same decode
    one position on (module doc); the caller has checked that the sequence owns its block alone."""
    return (next_position < len(seq.block_table) * block_size and has_static_decode_spec(group, spec)
            and len(seq.token_ids) + 1 - seq.num_prompt_tokens < group.max_output_tokens)


def has_static_decode_spec(group: SequenceGroup, spec: SampleSpec) -> bool:
    """Whether the sequence's spec changes with neither tokens nor positions (module doc)."""
    return (group.is_sample_spec_static and not spec.num_beam_candidates and not spec.suppress_token_ids
            and not spec.output_token_ids)


def wants_block_ahead(group: SequenceGroup, seq: Sequence, position: int, block_size: int) -> bool:
    """Whether a decode at `position` would make a longer run with its next block, or have the step
    after its run computed ahead (module doc): it holds none beyond the block of `position`, which
    leaves no more than MAX_RUN_STEPS positions from this one (a run of MAX_RUN_STEPS that fills
    them leaves the step after it in the next block) and fewer than the tokens its answer has to
    go, its last one included (a run that is not continuable takes it; a continuable one stops
    before it, and the step of the last token then uses the block)."""
    num_held = len(seq.block_table) * block_size - position
    return (len(seq.block_table) == position // block_size + 1  # none held ahead yet
            and num_held <= MAX_RUN_STEPS and num_held < _num_run_tokens_left(group, seq, through_last=True))


def _num_run_tokens_left(group: SequenceGroup, seq: Sequence, through_last: bool) -> int:
    """Steps a run may give the sequence: up to its answer's last token, or before it (run_length)."""
    return group.max_output_tokens - (len(seq.token_ids) - seq.num_prompt_tokens) - (0 if through_last else 1)


def run_length(group: SequenceGroup, seq: Sequence, position: int, block_size: int, through_last: bool) -> int:
    """How many steps a decode run may give a predictable decode at position: to the end of the
    blocks it holds, and up to the last token max_tokens leaves (through_last) or the token before
    it.

    A continuable run stops before the last token, which is planned alone, in a step that is not a
    run: a run that took it would leave the worker computing, ahead, a step past the end, which a
    new request's prefill would then wait for. The worker computes that last step ahead instead,
    while the scheduler applies the run. A run that is not continuable (more than
    MAX_CONTINUABLE_SEQS sequences) has nothing computed after it, so it takes the last token too:
    when the answers of a batch end at different lengths, each end then costs one plan, not two
    (the run up to it and the step of its last token)."""
    return min(MAX_RUN_STEPS, len(seq.block_table) * block_size - position,
               _num_run_tokens_left(group, seq, through_last))


def is_run_step(scheduler: Scheduler, num_scheduled: int, num_predictable: int, speculates: bool,
                has_operations: bool) -> bool:
    """Whether a step of num_scheduled sequences, num_predictable of them predictable decodes, is a
    decode run's first step (module doc); has_operations: block copies or swaps, tier operations,
    adapter loads."""
    return (0 < num_scheduled == num_predictable <= MAX_RUN_SEQS and not speculates
            and not scheduler.waiting and not scheduler.swapped and not has_operations)


def is_continuable_step(num_scheduled: int, is_run: bool) -> bool:
    """Whether a run step is also continuable: the worker may compute the step after it ahead."""
    return is_run and num_scheduled <= MAX_CONTINUABLE_SEQS
