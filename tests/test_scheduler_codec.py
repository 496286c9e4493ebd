"""Requests and their outputs survive the frontend <-> scheduler protobuf round trip unchanged."""

from __future__ import annotations

from pagedserve.internal import scheduler_pb2
from pagedserve.contracts.request_types import (
    CompletionDelta, Continuation, FinishReason, Request, RequestOutput, TokenLogprob,
)
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.contracts.scheduler_codec import output_from_proto, output_to_proto, request_from_proto, request_to_proto


def _request(seed: int | None) -> Request:
    # Values exact in float32 (the Sampling message's float fields).
    sampling = SamplingParams(max_tokens=40, min_tokens=2, temperature=0.5, top_p=0.875, top_k=4,
                              min_p=0.125, seed=seed, repetition_penalty=1.25, presence_penalty=0.5,
                              frequency_penalty=-0.5, stop_token_ids=[7, 9], ignore_eos=True, n=3,
                              beam_width=1, length_penalty=1.5, logprobs=2)
    return Request(request_id="r-1", prompt_token_ids=[1, 70000, 3], sampling=sampling, eos_token_ids=[2])


def test_request_round_trip() -> None:
    for seed in (None, 0, 2**40):
        request = _request(seed)
        msg = scheduler_pb2.SubmitRequest.FromString(request_to_proto(request, "frontend-a").SerializeToString())
        assert msg.frontend_id == "frontend-a"
        assert request_from_proto(msg, eos_token_ids=[2]) == request


def test_hold_output_round_trips() -> None:
    for hold in (False, True):
        request = _request(seed=None)
        request.hold_output = hold
        msg = scheduler_pb2.SubmitRequest.FromString(request_to_proto(request).SerializeToString())
        assert msg.hold_output is hold
        assert request_from_proto(msg, eos_token_ids=[2]) == request


def test_output_round_trip() -> None:
    output = RequestOutput(
        request_id="r-1",
        deltas=[
            CompletionDelta(index=0, token_ids=[5], logprobs=[TokenLogprob(5, -0.25, [5, 6], [-0.25, -1.5])],
                            cumulative_logprob=-0.25),
            CompletionDelta(index=1, token_ids=[8, 9], cumulative_logprob=-3.0, finish_reason=FinishReason.STOP),
            CompletionDelta(index=2, token_ids=[], finish_reason=FinishReason.ABORT),
            CompletionDelta(index=3, token_ids=[4], finish_reason=FinishReason.LENGTH),
        ],
        prompt_tokens=3,
        cached_prompt_tokens=16,
        is_finished=False,
    )
    msg = scheduler_pb2.SubmitResponse.FromString(output_to_proto(output).SerializeToString())
    assert output_from_proto("r-1", msg) == output


def test_continuations_round_trip() -> None:
    request = _request(seed=5)
    request.continuations = [Continuation(index=0, token_ids=[4, 5, 6], cumulative_logprob=-1.25),
                             Continuation(index=2, token_ids=[9], is_finished=True, cumulative_logprob=-0.5),
                             Continuation(index=1, token_ids=[])]
    msg = scheduler_pb2.SubmitRequest.FromString(request_to_proto(request).SerializeToString())
    assert [c.index for c in msg.continuations] == [0, 2, 1]
    assert request_from_proto(msg, eos_token_ids=[2]) == request
