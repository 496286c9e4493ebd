"""When a step is continuable (StepPlan.continuable): the worker may compute the step after it
before its plan arrives (worker/continuation.py), because that step is, unless a token ends a
sequence, the same decodes one position on.

    a sequence   decodes one sampled token in a block it owns alone (StepBuilder._emit_decode), the
                 next position stays in that block, its spec changes with neither tokens nor
                 positions (no penalties, no min_tokens window, no beams; structured output is
                 ruled out by the builder), and it has more tokens to go after this one
    the step     every sequence so, at most MAX_CONTINUABLE_SEQS of them, no speculation, nothing
                 waiting or swapped out, and no block operations, KV tier operations or adapter loads

A continuable step is a decode run (StepPlan.num_steps > 1) on a single-rank worker: the worker
computes its steps in a row, each one position on, so the scheduler plans, sends and receives one
plan for up to MAX_RUN_STEPS tokens of each sequence instead of one per token. When the run's
requests all take their whole answer at the end (Request.hold_output: nobody reads their tokens
one by one), the worker answers every step in one result, applied once. When some read tokens as
they come (StepPlan.streams_steps), it sends each step's result as soon as it is computed and the
scheduler applies it and hands its tokens out at once, then a result that ends the run: a token
leaves the worker when it would without runs, and the scheduler and the worker skip the plan of
every step but the first (the scheduler's step turned around on the same cores as the forward).
A run stays inside the blocks the plan gives (each sequence's last one) and short of every
sequence's last token (run_length). A continuable plan names the tokens that may end its
sequences (StepPlan.end_token_ids: EOS unless ignored, stop tokens); the worker ends a run after a
step that sampled one and computes nothing ahead of it, and the scheduler plans whatever follows
(a sequence the token did not end goes on in the next plan).
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

# At most this many steps in a decode run: the scheduler's cost per token falls as 1 / steps. A
# request that arrives (or is cancelled) during a run ends it after its current step (EndRun,
# scheduler/worker_link.py), so its prefill waits for one step, as it would without runs; the cap
# bounds what a lost EndRun could cost (8 steps of SmolLM2 at one stream on a 2-core CPU: 50-90 ms).
MAX_RUN_STEPS = 8


def is_predictable_decode(group: SequenceGroup, seq: Sequence, spec: SampleSpec, next_position: int,
                          block_size: int) -> bool:
    """Whether the step after this decode is, unless the token ends the sequence, the same decode
    one position on (module doc); the caller has checked that the sequence owns its block alone."""
    return (next_position % block_size != 0 and group.is_sample_spec_static
            and not spec.num_beam_candidates and not spec.suppress_token_ids and not spec.output_token_ids
            and len(seq.token_ids) + 1 - seq.num_prompt_tokens < group.max_output_tokens)


def run_length(group: SequenceGroup, seq: Sequence, position: int, block_size: int) -> int:
    """How many steps a decode run may give a predictable decode at position: to the end of its
    block, and up to the token before the last one max_tokens leaves. The last token is planned
    alone, in a step that is not continuable (its next would be past the answer): a run that took
    it would leave the worker computing, ahead, a step past the end, which a new request's prefill
    would then wait for. The worker computes that last step ahead instead, while the scheduler
    applies the run."""
    return min(MAX_RUN_STEPS, block_size - position % block_size,
               group.max_output_tokens - (len(seq.token_ids) - seq.num_prompt_tokens) - 1)


def is_continuable_step(scheduler: Scheduler, num_scheduled: int, num_predictable: int, speculates: bool,
                        has_operations: bool) -> bool:
    """Whether a step of num_scheduled sequences, num_predictable of them predictable decodes, is
    continuable (module doc); has_operations: block copies or swaps, tier operations, adapter loads."""
    return (0 < num_scheduled == num_predictable <= MAX_CONTINUABLE_SEQS and not speculates
            and not scheduler.waiting and not scheduler.swapped and not has_operations)
