"""Converts the internal Sampling proto to SamplingParams and scheduler outputs to protobuf."""

from __future__ import annotations

from pagedserve.internal import scheduler_pb2
from pagedserve.request_types import FinishReason, RequestOutput
from pagedserve.sampling_params import SamplingParams

_FINISH_TO_PROTO = {
    None: scheduler_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: scheduler_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: scheduler_pb2.FINISH_REASON_ABORT,
}


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
    )


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
    return msg


def output_to_proto(output: RequestOutput) -> scheduler_pb2.SubmitResponse:
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
