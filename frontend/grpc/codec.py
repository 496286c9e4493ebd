"""Frontend dataclasses -> public pagedserve.v1 protobuf messages (the process edge)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.frontend.generation.completion_state import CompletionFinish, CompletionState, CompletionUpdate
from pagedserve.frontend.generation.updates import Usage
from pagedserve.contracts.request_types import TokenLogprob
from pagedserve.v1 import generation_pb2

_FINISH_TO_PROTO = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    CompletionFinish.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    CompletionFinish.STOP: generation_pb2.FINISH_REASON_STOP,
    CompletionFinish.STOP_SEQUENCE: generation_pb2.FINISH_REASON_STOP_SEQUENCE,
}


def _fill_completion(msg: generation_pb2.Completion, index: int, text: str, token_ids: Sequence[int],
                     logprobs: Sequence[TokenLogprob], cumulative_logprob: float,
                     finish: CompletionFinish | None, stop_sequence: str | None) -> generation_pb2.Completion:
    msg.index = index
    msg.text = text
    msg.token_ids.extend(token_ids)
    for logprob in logprobs:
        token = msg.logprobs.add(token_id=logprob.token_id, logprob=logprob.logprob)
        for top_id, top_logprob in zip(logprob.top_token_ids, logprob.top_logprobs):
            token.top.add(token_id=top_id, logprob=top_logprob)
    msg.cumulative_logprob = cumulative_logprob
    msg.finish_reason = _FINISH_TO_PROTO[finish]
    if stop_sequence is not None:
        msg.stop_sequence = stop_sequence
    return msg


def usage_to_proto(usage: Usage) -> generation_pb2.Usage:
    return generation_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                cached_prompt_tokens=usage.cached_prompt_tokens)


def stream_message(request_id: str, updates: Sequence[CompletionUpdate], usage: Usage | None) -> generation_pb2.GenerateResponse:
    """One GenerateStream message: what each named completion gained; usage on the last message."""
    msg = generation_pb2.GenerateResponse(request_id=request_id)
    for update in updates:
        _fill_completion(msg.completions.add(), update.index, update.text, update.token_ids, update.logprobs,
                         update.cumulative_logprob, update.finish, update.stop_sequence)
    if usage is not None:
        msg.usage.CopyFrom(usage_to_proto(usage))
    return msg


def whole_response(request_id: str, states: Sequence[CompletionState], usage: Usage) -> generation_pb2.GenerateResponse:
    """The Generate answer: every completion in full, in index order (beam search: best first)."""
    msg = generation_pb2.GenerateResponse(request_id=request_id, usage=usage_to_proto(usage))
    for state in sorted(states, key=lambda s: s.index):
        _fill_completion(msg.completions.add(), state.index, state.text, state.token_ids, state.logprobs,
                         state.cumulative_logprob, state.finish, state.stop_sequence)
    return msg


def finish_label(states: Sequence[CompletionState]) -> str:
    """The metrics label of a finished request: the finish reason of its first completion."""
    first = min(states, key=lambda s: s.index)
    return first.finish.value if first.finish is not None else "error"
