"""The request types the frontend and the scheduler exchange (no torch, no protobuf): a Request
in, RequestOutputs back (one per step that changed it), each holding CompletionDeltas.
scheduler_codec.py converts them to and from the internal protobuf at the process edge.

A Request resubmitted after its scheduler was lost carries Continuations: per output index, the
tokens already generated (and streamed to the client). The new scheduler computes prompt +
generated tokens again and goes on from there, counting the generated tokens as outputs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.contracts.sampling_params import SamplingParams


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached, or max_model_len
    STOP = "stop"  # EOS or a stop token id
    ABORT = "abort"  # aborted by the client or by a stop string in the frontend


@dataclass(slots=True)
class Continuation:
    """What one completion (output index) of a resubmitted request already has."""

    index: int
    token_ids: list[int]  # generated so far: outputs, not prompt
    is_finished: bool = False  # it ended already (stop, length, stop string): not resumed
    cumulative_logprob: float = 0.0  # of token_ids, so the resumed completion reports the total


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """The LoRA adapter a request runs with: its name, PEFT folder and content digest (the
    digest, never the name, keys its prefix cache and its worker slot)."""

    name: str
    path: str
    digest: str


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    continuations: list[Continuation] = field(default_factory=list)  # empty: a fresh start
    priority: int = 0  # lower is served first under --scheduling-policy priority
    adapter: AdapterRef | None = None  # None: the base model
    # the client takes the whole result at the end: the scheduler sends the first output, then
    # the rest merged (scheduler/undelivered_output.py); the engine does not look at it
    hold_output: bool = False


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class CompletionDelta:
    """New tokens of one completion since the last output (beam search: all tokens, once)."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # filled when logprobs were asked for
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    deltas: list[CompletionDelta]
    prompt_tokens: int
    cached_prompt_tokens: int
    is_finished: bool
