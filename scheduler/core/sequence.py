"""Sequences and sequence groups: the scheduler's state of one request.

A sequence is one stream of tokens (prompt + outputs) with a block table. Its KV is computed
left to right; each step computes a chunk of the uncomputed tail and, when the chunk reaches the
end, samples one more token:

    token_ids   [ prompt ............................ | outputs ......... ]
                [ computed: KV in blocks     ][ uncomputed: next chunks   ]
                0                 num_computed_tokens               num_tokens

A decode is the case where exactly the last sampled token is uncomputed.

A group is every sequence of one request (n parallel samples, or the live beams of a beam
search); it is scheduled, swapped and preempted as a unit. Sequences that start from a shared
prefix (n > 1 samples, or any multi-sequence group recomputed after preemption) compute it once:
the leader computes tokens [0, fork_at) alone, the followers then copy its block table and
compute their own tails (BlockManager.fork_if_ready, copy-on-write).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.contracts.request_types import FinishReason, Request, TokenLogprob
from pagedserve.contracts.step_plan import SampleSpec

if TYPE_CHECKING:
    from pagedserve.scheduler.beam.search import BeamSearchState
    from pagedserve.scheduler.structured_output.matcher import SequenceMatcher


class GroupStatus(enum.Enum):
    WAITING = "waiting"  # no blocks; prefilled (again) when admitted
    RUNNING = "running"  # blocks on the GPU
    SWAPPED = "swapped"  # blocks on the CPU
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    output_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix keys of full blocks, computed lazily
    num_registered_blocks: int = 0  # leading table blocks already offered to the prefix cache
    cumulative_logprob: float = 0.0
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    sample_spec: SampleSpec | None = None  # reused while nothing in it changes
    # Speculation: while a step is in flight, the last num_draft_tokens of token_ids are proposals
    # being verified (spec_drafting.py); they are removed when its result comes back.
    num_draft_tokens: int = 0
    num_spec_misses: int = 0  # verifying steps in a row that accepted nothing
    num_spec_pauses_left: int = 0  # decode steps to go without proposals (after misses)
    # Draft-model speculation: leading positions whose draft-model KV this sequence's own draft
    # forwards computed (or its parent's, when forked: copy-on-write copies draft KV too). The
    # next drafting step sends token_ids[num_draft_computed : position of the last real token]
    # as draft context; 0 after any preemption, a reset or a prefix-cache hit (cached blocks
    # may lack draft KV). Never more than num_computed_tokens between steps.
    num_draft_computed: int = 0
    # Structured output: the grammar's state after exactly the real output tokens (matcher.py).
    matcher: SequenceMatcher | None = None
    key_root: bytes | None = None  # parent key of the first block (LoRA: from the adapter's digest)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def drop_drafts(self) -> None:
        """Removes proposals not yet verified from token_ids."""
        if self.num_draft_tokens:
            del self.token_ids[-self.num_draft_tokens:]
            self.num_draft_tokens = 0

    def reset_computation(self) -> None:
        """Forgets the KV state (table already released): everything is recomputed later."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_registered_blocks = 0
        self.num_draft_computed = 0

    def copy_as(self, seq_id: int, output_index: int) -> Sequence:
        """A new sequence with the same tokens and progress; the caller shares the table."""
        return Sequence(
            seq_id=seq_id,
            output_index=output_index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_tokens=self.num_computed_tokens,
            block_keys=list(self.block_keys),
            num_registered_blocks=self.num_registered_blocks,
            num_draft_computed=self.num_draft_computed,
            key_root=self.key_root,
            cumulative_logprob=self.cumulative_logprob,
            output_logprobs=list(self.output_logprobs),
            matcher=self.matcher.fork() if self.matcher is not None else None,
        )


@dataclass(eq=False)
class SequenceGroup:
    request: Request
    arrival_index: int  # FCFS order: smaller is older
    seqs: list[Sequence]  # unfinished sequences (beam search: the live beams, best first)
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    max_output_tokens: int  # min(max_tokens, max_model_len - prompt length)
    # Effective priority, lower first: the request's under --scheduling-policy priority, 0 under
    # fcfs. Every queue is ordered by queue_key = (priority, arrival_index).
    priority: int = 0
    status: GroupStatus = GroupStatus.WAITING
    fork_at: int | None = None  # seqs[1:] wait until seqs[0] has computed this many tokens
    beam: BeamSearchState | None = None  # beam search requests only
    num_cached_prompt_tokens: int = 0
    is_admitted_once: bool = False
    has_waited_for_disk: bool = False  # its admission waited a step for KV tier fetches (kv_tiers.py)
    num_completions_done: int = 0
    is_sample_spec_static: bool = False  # no penalties and no min_tokens window: specs never change
    num_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.request.prompt_token_ids)
        sampling = self.request.sampling
        self.is_sample_spec_static = not sampling.has_penalties and (
            sampling.min_tokens == 0 or not self.stop_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def queue_key(self) -> tuple[int, int]:
        """Order in every queue: priority (lower first), then arrival (older first)."""
        return (self.priority, self.arrival_index)

    @property
    def max_num_running_seqs(self) -> int:
        """Sequence slots the group may occupy in a step (a beam search grows to beam_width)."""
        if self.beam is not None:
            return self.request.sampling.beam_width
        return len(self.seqs)

    def runnable_seqs(self) -> list[Sequence]:
        """Sequences that may compute tokens now (followers wait for the leader's prefix)."""
        if self.fork_at is None:
            return self.seqs
        return self.seqs[:1]

    def prefill_target(self, seq: Sequence) -> int:
        """How many tokens seq should have computed before it samples (leader: fork_at)."""
        if self.fork_at is not None and seq is self.seqs[0]:
            return self.fork_at
        return len(seq.token_ids)

    def plan_shared_prefix(self) -> None:
        """Sets fork_at so a group that (re)starts from scratch computes its common prefix once."""
        self.fork_at = None
        if len(self.seqs) < 2:
            return
        first = self.seqs[0].token_ids
        common = min(len(seq.token_ids) for seq in self.seqs) - 1  # each one keeps a token to sample
        for seq in self.seqs[1:]:
            tokens = seq.token_ids
            limit = min(common, len(tokens))
            if first[:limit] == tokens[:limit]:
                common = limit
                continue
            index = 0
            while index < limit and first[index] == tokens[index]:
                index += 1
            common = index
        if common > 0:
            self.fork_at = common
