"""Deltas of several tokens (speculative decoding emits up to K + 1 per step) against stop
strings: the completion ends at the token that completes the stop string, as with one token per
delta."""

from __future__ import annotations

from pagedserve.frontend.generation.completion_state import CompletionFinish, CompletionState
from pagedserve.contracts.request_types import CompletionDelta, FinishReason, TokenLogprob
from pagedserve.contracts.sampling_params import SamplingParams


def _run(tokenizer, token_ids: list[int], chunk: int, **params) -> CompletionState:
    state = CompletionState(0, SamplingParams(**params), tokenizer)
    cumulative = 0.0
    for start in range(0, len(token_ids), chunk):
        piece = token_ids[start:start + chunk]
        logprobs = [TokenLogprob(token, -0.5) for token in piece] if params.get("logprobs") else []
        cumulative -= 0.5 * len(piece)
        is_last = start + chunk >= len(token_ids)
        if state.apply(CompletionDelta(0, piece, logprobs, cumulative, FinishReason.LENGTH if is_last else None)) is None:
            break
    return state


def test_a_stop_string_inside_a_multi_token_delta_ends_at_its_token(tokenizer):
    token_ids = tokenizer.encode("one two three four five six seven")[1:]
    for params in (dict(stop=["four"]), dict(stop=["four"], logprobs=1), dict(stop=["thr"], include_stop_str_in_output=True)):
        single = _run(tokenizer, token_ids, 1, **params)
        for chunk in (2, 3, 5):
            multi = _run(tokenizer, token_ids, chunk, **params)
            assert multi.finish is CompletionFinish.STOP_SEQUENCE
            assert (multi.text, multi.token_ids) == (single.text, single.token_ids), (params, chunk)
            assert len(multi.token_ids) < len(token_ids)
            if params.get("logprobs"):
                assert multi.cumulative_logprob == single.cumulative_logprob == -0.5 * len(single.token_ids)


def test_without_stop_strings_a_multi_token_delta_is_taken_whole(tokenizer):
    token_ids = tokenizer.encode("one two three four")[1:]
    state = _run(tokenizer, token_ids, 4)
    assert state.token_ids == token_ids and state.finish is CompletionFinish.LENGTH
