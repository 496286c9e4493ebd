"""Sends benchmark requests to a pagedserve frontend over GenerateStream and times every token.

One asyncio task per request on one channel; a request is sent at its arrival time (all at once
when none is given). Each stream message is stamped on arrival, with the number of tokens it
carries, so TTFT, inter-token latency and the token rate of any interval can be computed after
the run. With whole=True the requests go over unary Generate instead (the whole answer at the
end, as a client that does not stream asks): every token is then stamped at the answer's arrival.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from lib.workload import BenchRequest


@dataclass(slots=True)
class RequestTrace:
    prompt_len: int
    max_tokens: int
    sent_at: float = 0.0  # time.perf_counter()
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    finished_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent_at

    @property
    def latency(self) -> float:
        return self.finished_at - self.sent_at

    @property
    def inter_token_gaps(self) -> list[float]:
        """Gaps between consecutive stream messages, one per token after the first (tokens of one
        message share its arrival time, so a message of k tokens counts its gap once and k - 1 zeros)."""
        times = self.token_times
        return [later - earlier for earlier, later in zip(times, times[1:])]


def greedy_request(request: BenchRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=pb.PromptTokenIds(ids=request.prompt_token_ids),
        params=pb.SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True))


async def _one(stub, request: BenchRequest, trace: RequestTrace, start: float, delay: float,
               on_done, whole: bool) -> None:
    if delay > 0:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    trace.sent_at = time.perf_counter()
    if whole:
        response = await stub.Generate(greedy_request(request))
        now = trace.finished_at = time.perf_counter()
        trace.token_times.extend([now] * sum(len(completion.token_ids) for completion in response.completions))
        on_done()
        return
    async for response in stub.GenerateStream(greedy_request(request)):
        now = time.perf_counter()
        for completion in response.completions:
            trace.token_times.extend([now] * len(completion.token_ids))
    trace.finished_at = time.perf_counter()
    on_done()


async def _run_all(address: str, requests: list[BenchRequest], arrivals: list[float] | None,
                   on_done, whole: bool, sequential: bool) -> list[RequestTrace]:
    traces = [RequestTrace(request.prompt_len, request.max_tokens) for request in requests]
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        delays = arrivals or [0.0] * len(requests)
        if sequential:
            for request, trace in zip(requests, traces):
                await _one(stub, request, trace, start, 0.0, on_done, whole)
        else:
            await asyncio.gather(*(_one(stub, request, trace, start, delay, on_done, whole)
                                   for request, trace, delay in zip(requests, traces, delays)))
    return traces


def run_requests(address: str, requests: list[BenchRequest], arrivals: list[float] | None = None,
                 on_done=lambda: None, whole: bool = False, sequential: bool = False) -> list[RequestTrace]:
    """Blocks until every request finished; arrivals are seconds after the start, one per request;
    whole: over unary Generate (the module's docstring); sequential: each request sent when the one
    before it has finished (arrivals ignored), on the same channel, as one client in a loop does."""
    if sequential and arrivals:
        raise ValueError("sequential requests take no arrival times")
    return asyncio.run(_run_all(address, requests, arrivals, on_done, whole, sequential))
