"""The frontend <-> scheduler edge: a request and its outputs to and from the internal protobuf
(proto/pagedserve/internal/scheduler.proto). The small control messages (FinishCompletion,
GetInfo, GetStats) are built where they are sent.

```
 frontend (scheduler_client.py)                         scheduler (server.py)
 Request        ── request_to_proto ──►  SubmitRequest  ── request_from_proto ──►  Request
 RequestOutput  ◄─ output_from_proto ──  SubmitResponse ◄─ output_to_proto ─────  RequestOutput
```

SamplingParams travel as the Sampling message with every default already resolved by the
frontend; the stop strings stay in the frontend, which applies them to text. A resubmitted
request's Continuations (per output index: tokens generated so far, finished or not) travel with
it.
"""

from __future__ import annotations

from pagedserve.internal import scheduler_pb2
from pagedserve.contracts.request_types import (
    AdapterRef, CompletionDelta, Continuation, FinishReason, Request, RequestOutput, TokenLogprob,
)
from pagedserve.contracts.constraint import Constraint, ConstraintKind
from pagedserve.contracts.sampling_params import SamplingParams

_FINISH_TO_PROTO = {
    None: scheduler_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: scheduler_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: scheduler_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {code: reason for reason, code in _FINISH_TO_PROTO.items()}


def sampling_from_proto(msg: scheduler_pb2.Sampling) -> SamplingParams:
    """The frontend resolved every default already; this copies the fields across."""
    return SamplingParams(
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.has_seed else None,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        n=msg.n,
        beam_width=msg.beam_width,
        length_penalty=msg.length_penalty,
        logprobs=msg.logprobs,
        constraint=constraint_from_proto(msg),
        logit_bias=dict(msg.logit_bias),
    )


def constraint_from_proto(msg) -> Constraint | None:
    """The `constraint` oneof of a SamplingParams (public) or Sampling (internal) message."""
    which = msg.WhichOneof("constraint")
    if which is None:
        return None
    kind = ConstraintKind(which)
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, choices=tuple(msg.choice.choices))
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind) if msg.json_object else None
    return Constraint(kind, value=getattr(msg, which))


def constraint_to_proto(constraint: Constraint | None, msg) -> None:
    """Sets the `constraint` oneof of msg (SamplingParams or Sampling)."""
    if constraint is None:
        return
    kind = constraint.kind
    if kind is ConstraintKind.CHOICE:
        msg.choice.choices.extend(constraint.choices)
    elif kind is ConstraintKind.JSON_OBJECT:
        msg.json_object = True
    else:
        setattr(msg, kind.value, constraint.value)


def sampling_to_proto(params: SamplingParams) -> scheduler_pb2.Sampling:
    msg = scheduler_pb2.Sampling(
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        n=params.n,
        beam_width=params.beam_width,
        length_penalty=params.length_penalty,
        logprobs=params.logprobs,
    )
    if params.seed is not None:
        msg.has_seed = True
        msg.seed = params.seed
    constraint_to_proto(params.constraint, msg)
    for token_id, bias in params.logit_bias.items():
        msg.logit_bias[token_id] = bias
    return msg


def request_to_proto(request: Request, frontend_id: str = "") -> scheduler_pb2.SubmitRequest:
    """The EOS ids stay behind: the scheduler takes them from its own model config."""
    msg = scheduler_pb2.SubmitRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_to_proto(request.sampling),
        frontend_id=frontend_id,
        priority=request.priority,
        hold_output=request.hold_output,
    )
    if request.adapter is not None:
        msg.adapter.name, msg.adapter.path, msg.adapter.digest = (request.adapter.name, request.adapter.path,
                                                                  request.adapter.digest)
    for continuation in request.continuations:
        msg.continuations.add(index=continuation.index, token_ids=continuation.token_ids,
                              is_finished=continuation.is_finished,
                              cumulative_logprob=continuation.cumulative_logprob)
    return msg


def request_from_proto(msg: scheduler_pb2.SubmitRequest, eos_token_ids: list[int]) -> Request:
    return Request(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling),
        eos_token_ids=list(eos_token_ids),
        priority=msg.priority,
        hold_output=msg.hold_output,
        continuations=[
            Continuation(index=c.index, token_ids=list(c.token_ids), is_finished=c.is_finished,
                         cumulative_logprob=c.cumulative_logprob)
            for c in msg.continuations
        ],
        adapter=(AdapterRef(msg.adapter.name, msg.adapter.path, msg.adapter.digest)
                 if msg.HasField("adapter") else None),
    )


def output_to_proto(output: RequestOutput) -> scheduler_pb2.SubmitResponse:
    """The request id is left out: the Submit stream it travels on names the request."""
    msg = scheduler_pb2.SubmitResponse(
        prompt_tokens=output.prompt_tokens,
        cached_prompt_tokens=output.cached_prompt_tokens,
        is_finished=output.is_finished,
    )
    for delta in output.deltas:
        out = msg.deltas.add(index=delta.index, cumulative_logprob=delta.cumulative_logprob,
                             finish_reason=_FINISH_TO_PROTO[delta.finish_reason])
        out.token_ids.extend(delta.token_ids)
        for lp in delta.logprobs:
            token = out.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
            for top_id, top_lp in zip(lp.top_token_ids, lp.top_logprobs):
                token.top.add(token_id=top_id, logprob=top_lp)
    return msg


def output_from_proto(request_id: str, msg: scheduler_pb2.SubmitResponse) -> RequestOutput:
    deltas = [
        CompletionDelta(
            index=delta.index,
            token_ids=list(delta.token_ids),
            logprobs=[
                TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                             top_token_ids=[top.token_id for top in lp.top],
                             top_logprobs=[top.logprob for top in lp.top])
                for lp in delta.logprobs
            ],
            cumulative_logprob=delta.cumulative_logprob,
            finish_reason=_FINISH_FROM_PROTO.get(delta.finish_reason),
        )
        for delta in msg.deltas
    ]
    return RequestOutput(request_id=request_id, deltas=deltas, prompt_tokens=msg.prompt_tokens,
                         cached_prompt_tokens=msg.cached_prompt_tokens, is_finished=msg.is_finished)
