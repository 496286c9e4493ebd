"""The scheduler's Submit stream (scheduler/server.py) against a stand-in engine: outputs that are
already waiting when the stream writes go out as one message, an error behind them still ends the
stream with its status."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from pagedserve.internal import scheduler_pb2
from pagedserve.model_config import ModelInfo
from pagedserve.scheduler.engine import EngineUnavailable
from pagedserve.scheduler.outputs import CompletionDelta, FinishReason, RequestOutput, merge_outputs
from pagedserve.scheduler.server import SchedulerServicer

MODEL = ModelInfo(name="m", path=Path("."), architecture="LlamaForCausalLM", vocab_size=32,
                  max_position_embeddings=64, num_layers=1, num_heads=1, num_kv_heads=1, head_size=8,
                  hidden_size=8, eos_token_ids=[2])


class StandInEngine:
    def __init__(self) -> None:
        self.sinks = []
        self.aborted = []

    def submit(self, request, sink) -> None:
        self.sinks.append(sink)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class Aborted(Exception):
    pass


class StandInContext:
    def __init__(self) -> None:
        self.code = None

    async def abort(self, code, details):
        self.code = code
        raise Aborted(details)

    def time_remaining(self):
        return None


def _output(tokens: list[int], index: int = 0, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", [CompletionDelta(index, tokens, finish_reason=finish)], 5, 0, finish is not None)


def _request() -> scheduler_pb2.SubmitRequest:
    request = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[3, 4, 5, 6, 7])
    request.sampling.max_tokens = 8
    return request


async def _collect(items: list, context: StandInContext) -> tuple[list, StandInEngine]:
    engine = StandInEngine()
    stream = SchedulerServicer(engine, MODEL, 1).Submit(_request(), context)
    messages = []
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the stream has submitted and waits for its first output
    for item in items:
        engine.sinks[0](item)
    try:
        messages.append(await first)
        async for message in stream:
            messages.append(message)
    except Aborted:
        pass
    return messages, engine


def test_outputs_waiting_together_go_out_as_one_message():
    items = [_output([10]), _output([11], index=1), _output([12]), _output([13], finish=FinishReason.LENGTH)]
    messages, engine = asyncio.run(_collect(items, StandInContext()))
    (message,) = messages
    assert [(delta.index, list(delta.token_ids)) for delta in message.deltas] == [(0, [10]), (1, [11]), (0, [12]),
                                                                                  (0, [13])]
    assert message.is_finished and message.prompt_tokens == 5
    assert engine.aborted == []


def test_an_error_behind_waiting_outputs_still_ends_the_stream():
    context = StandInContext()
    messages, engine = asyncio.run(_collect([_output([10]), _output([11]), EngineUnavailable("workers lost")],
                                            context))
    (message,) = messages
    assert [list(delta.token_ids) for delta in message.deltas] == [[10], [11]]
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert engine.aborted == []  # the engine failed the request itself


def test_merge_keeps_every_delta_in_order_and_the_later_state():
    earlier = RequestOutput("r", [CompletionDelta(0, [1])], 7, 0, False)
    later = RequestOutput("r", [CompletionDelta(0, [2], finish_reason=FinishReason.STOP)], 0, 16, True)
    merged = merge_outputs(earlier, later)
    assert [delta.token_ids for delta in merged.deltas] == [[1], [2]]
    assert (merged.prompt_tokens, merged.cached_prompt_tokens, merged.is_finished) == (7, 16, True)


@pytest.mark.parametrize("num_waiting", [1, 3])
def test_a_finished_output_is_never_merged_with_what_follows(num_waiting):
    items = [_output([10 + i]) for i in range(num_waiting - 1)] + [_output([20], finish=FinishReason.STOP),
                                                                  _output([99])]
    messages, _ = asyncio.run(_collect(items, StandInContext()))
    (message,) = messages
    assert [delta.token_ids for delta in message.deltas][-1] == [20]
    assert 99 not in [token for delta in message.deltas for token in delta.token_ids]
