"""Resolved sampling parameters shared by the frontend and the scheduler (no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.contracts.constraint import MAX_ABS_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, Constraint

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_N = 64
MAX_BEAM_WIDTH = 32
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_ABS_LENGTH_PENALTY = 10.0


class InvalidParameter(ValueError):
    """A request parameter is out of range; `field_name` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


@dataclass(slots=True)
class SamplingParams:
    """Sampling parameters with every proto3 zero already resolved to its default."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    logprobs: int = 0
    constraint: Constraint | None = None  # structured output (contracts/constraint.py)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    @property
    def is_constrained(self) -> bool:
        return self.constraint is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def num_completions(self) -> int:
        return self.beam_width if self.is_beam_search else self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises InvalidParameter naming the first field that is out of range."""
        _check_finite(self)
        if self.max_tokens < 1:
            raise InvalidParameter("max_tokens", "must be at least 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", "must be between 0 and max_tokens")
        if self.temperature < 0.0:
            raise InvalidParameter("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidParameter("top_k", "must be >= 0 (0 disables top-k)")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", "must be in [0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidParameter("seed", "must be in [0, 2^63)")
        if self.repetition_penalty <= 0.0:
            raise InvalidParameter("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidParameter("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidParameter("frequency_penalty", "must be in [-2, 2]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameter("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for text in self.stop:
            if not text:
                raise InvalidParameter("stop", "stop strings must not be empty")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise InvalidParameter("stop", f"a stop string has at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameter("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        if vocab_size is not None:
            for token_id in self.stop_token_ids:
                if not 0 <= token_id < vocab_size:
                    raise InvalidParameter("stop_token_ids", f"token id {token_id} is outside the vocabulary")
        if not 1 <= self.n <= MAX_N:
            raise InvalidParameter("n", f"must be in [1, {MAX_N}]")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidParameter("beam_width", f"must be in [1, {MAX_BEAM_WIDTH}]")
        if self.is_beam_search:
            if self.temperature != 0.0:
                raise InvalidParameter("beam_width", "beam search is deterministic: temperature must be 0")
            if self.n != 1:
                raise InvalidParameter("n", "use beam_width alone for beam search (n must be 0 or 1)")
            if self.top_p != 1.0 or self.top_k != 0 or self.min_p != 0.0:
                raise InvalidParameter("beam_width", "beam search does not combine with top_p, top_k or min_p")
            if vocab_size is not None:
                # every step ranks max(2, 1 + stop ids) * beam_width candidates
                num_candidates = max(2, 1 + len(set(self.stop_token_ids))) * self.beam_width
                if num_candidates > vocab_size:
                    raise InvalidParameter(
                        "stop_token_ids", f"beam search over {self.beam_width} beams with "
                        f"{len(set(self.stop_token_ids))} stop token ids ranks {num_candidates} candidates a step, "
                        f"more than the vocabulary ({vocab_size}) holds")
        if not -MAX_ABS_LENGTH_PENALTY <= self.length_penalty <= MAX_ABS_LENGTH_PENALTY:
            raise InvalidParameter("length_penalty",
                                   f"must be in [-{MAX_ABS_LENGTH_PENALTY:g}, {MAX_ABS_LENGTH_PENALTY:g}]")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParameter("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        self._validate_structured(vocab_size)

    def _validate_structured(self, vocab_size: int | None) -> None:
        if self.constraint is not None:
            problem = self.constraint.check_size()
            if problem is not None:
                raise InvalidParameter(self.constraint.field_name, problem)
            if self.is_beam_search:
                raise InvalidParameter("beam_width", "beam search does not combine with a structured-output "
                                                     "constraint (use n for several samples)")
            if self.min_tokens:
                raise InvalidParameter("min_tokens", "does not combine with a structured-output constraint "
                                                     "(the grammar decides where the output ends)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidParameter("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for token_id, bias in self.logit_bias.items():
            if not math.isfinite(bias) or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise InvalidParameter("logit_bias", f"the bias of token {token_id} must be in "
                                                     f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
            if token_id < 0 or vocab_size is not None and token_id >= vocab_size:
                raise InvalidParameter("logit_bias", f"token id {token_id} is outside the vocabulary")


def _check_finite(params: SamplingParams) -> None:
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "length_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise InvalidParameter(name, "must be a finite number")
