"""What the scheduler asks the workers to do in one step, and what rank 0 answers (no torch).

A step computes KV for some new tokens of each scheduled sequence and, for sequences whose
prompt is fully computed, samples one next token:

    positions   0 ........ start_position ....... start_position + len(token_ids) - 1
    tokens      [ cached KV: already in blocks ][ token_ids: computed in this step ]
    blocks      block_table covers every position up to the last new token
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.contracts.tier_ops import TierOps


@dataclass(slots=True)
class SampleSpec:
    """How to pick the next token of one sequence."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    output_index: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_logprobs: int = 0
    num_beam_candidates: int = 0  # > 0: beam search; return this many (token, logprob) candidates
    suppress_token_ids: list[int] = field(default_factory=list)  # never sampled (min_tokens)
    prompt_token_ids: list[int] = field(default_factory=list)  # sent only when a penalty is active
    output_token_ids: list[int] = field(default_factory=list)  # sent only when a penalty is active
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the raw logits first

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]  # tokens whose KV is computed in this step
    start_position: int  # position of token_ids[0]
    block_table: list[int]  # physical blocks covering [0, start_position + len(token_ids))
    sample: SampleSpec | None = None  # None: a prefill chunk that is not the prompt's last
    # Speculation: the last num_draft_tokens of token_ids are proposals. The worker samples a row
    # at the last real token and at each draft, and answers with one SeqSample per emitted token
    # (the accepted drafts, then the token drawn at the first rejection or the bonus token).
    num_draft_tokens: int = 0
    # Draft-model speculation (StepPlan.drafts_from_worker): the drafts above are placeholders the
    # worker replaces with its draft model's proposals. Before proposing, the draft model computes
    # its own KV for draft_context_ids, the tokens at positions draft_start_position .. up to (not
    # including) the last real token whose draft KV this sequence has not computed yet; then it
    # runs the last real token and its own proposals d1 .. d(k-1) (same slots as the target).
    draft_context_ids: list[int] = field(default_factory=list)
    draft_start_position: int = 0
    # Structured output: num_mask_rows token bitmask rows (one per row the sequence samples:
    # 1 + num_draft_tokens), ceil(vocab / 32) little-endian int32 words each; bit i allows token
    # i. 0 rows and b"": unconstrained.
    num_mask_rows: int = 0
    token_bitmask: bytes = b""
    lora_slot: int = -1  # the worker's adapter slot whose LoRA delta this sequence adds; -1: the base model

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class LoraLoad:
    """Put the adapter at path (content digest) in the worker's LoRA slot before this step."""

    slot: int
    name: str
    path: str
    digest: str


@dataclass(slots=True)
class StepPlan:
    """Block operations run in this order before the forward: swap out, swap in, copy."""

    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src gpu, dst gpu)
    epoch: int = 0
    drafts_from_worker: bool = False  # the drafts of this step are for the worker's draft model to propose
    tier_ops: TierOps | None = None  # KV tiers (tier_ops.py): saves first, fetches, loads before the copies
    # Structured output: the sequences' num_mask_rows are set but their token_bitmask rows come
    # in a StepMasks message after the plan (computed while the workers run the forward).
    masks_follow: bool = False
    lora_loads: list[LoraLoad] = field(default_factory=list)  # run before the forward
    # Every sequence decodes one token it samples in a block it owns alone with room for the next,
    # under a spec its tokens do not change, and nothing waits: a single-rank worker may compute
    # the likely next plan ahead (worker/continuation.py)
    continuable: bool = False
    # More than 1: a decode run (scheduler/core/continuable.py: every sequence decodes one token it
    # samples with room in its blocks, under a spec its tokens do not change, and nothing waits;
    # up to 32 sequences, continuable or not). A single-rank worker computes up to
    # num_steps steps in a row, each one position on with the tokens the step before sampled, and
    # answers them all in one StepResult, or each as it comes with streams_steps
    num_steps: int = 1
    # Of a decode run or a continuable plan: tokens that may end one of its sequences (EOS unless
    # ignored, stop tokens); the worker computes nothing more after a step that sampled one
    end_token_ids: list[int] = field(default_factory=list)
    # Of a decode run some of whose requests read tokens as they come: each step's StepResult is
    # sent as soon as it is computed (StepResult.run_step), then a result that ends the run
    streams_steps: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.seqs)


@dataclass(slots=True)
class SeqSample:
    """The token sampled for one sequence, with the log-probabilities asked for."""

    seq_id: int
    token_id: int
    logprob: float  # log-probability of token_id under the model's distribution
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    beam_token_ids: list[int] = field(default_factory=list)  # beam search candidates, best first
    beam_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SeqFailure:
    """A sequence the worker could not sample for: its request fails, the others go on."""

    seq_id: int
    message: str


@dataclass(slots=True)
class StepResult:
    step_id: int
    samples: list[SeqSample] = field(default_factory=list)
    forward_seconds: float = 0.0
    epoch: int = 0
    failures: list[SeqFailure] = field(default_factory=list)
    failed_fetch_keys: list[bytes] = field(default_factory=list)  # block files no rank could use
    # The steps of a decode run computed (StepPlan.num_steps): samples holds each step's, every
    # sequence of the plan in plan order, one step after the other; a run has no failures
    num_steps: int = 1
    # Of a run that streams its steps (StepPlan.streams_steps): 1 + the index in the run of the one
    # step this result holds; 0 ends the run (no samples, num_steps steps computed)
    run_step: int = 0
