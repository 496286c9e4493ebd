"""A request's unread output in the scheduler is bounded in bytes: past the cap the request is
aborted once, what was queued is dropped, and the stream reads OutputOverflow."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.contracts.request_types import CompletionDelta, RequestOutput
from pagedserve.scheduler.undelivered_output import Delivery, OutputOverflow, UndeliveredOutput


def _output(num_tokens: int, is_finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [CompletionDelta(0, list(range(num_tokens)))], prompt_tokens=3,
                         cached_prompt_tokens=0, is_finished=is_finished)


def test_output_read_as_it_comes_never_reaches_the_cap():
    async def run() -> None:
        aborted = []
        outputs = UndeliveredOutput(300, lambda: aborted.append(True))
        for _ in range(100):
            outputs.put(_output(100))  # each message is over a third of the cap: two would overflow
            item = await outputs.get()
            assert isinstance(item, Delivery) and list(item.message.deltas[0].token_ids) == list(range(100))
        assert not aborted and outputs.num_bytes == 0

    asyncio.run(run())


def test_a_single_message_over_the_cap_is_let_through():
    async def run() -> None:
        outputs = UndeliveredOutput(10, lambda: pytest.fail("aborted"))
        outputs.put(_output(100, is_finished=True))
        assert (await outputs.get()).output.is_finished

    asyncio.run(run())


def test_unread_output_past_the_cap_aborts_the_request_once_and_frees_the_queue():
    async def run() -> None:
        aborted = []
        outputs = UndeliveredOutput(1000, lambda: aborted.append(True))
        num_put = 0
        while not outputs.has_overflowed:
            outputs.put(_output(20))
            num_put += 1
            assert num_put < 1000
        assert 1000 // 60 <= num_put <= 1000 // 20 + 1  # a 20-token message is 20 to 60 bytes
        assert aborted == [True] and outputs.num_bytes == 0
        for _ in range(10):  # what the engine sends before it sees the abort is dropped
            outputs.put(_output(20))
        assert aborted == [True] and outputs.num_bytes == 0
        item = await outputs.get()
        assert isinstance(item, OutputOverflow) and "more than 1000 bytes" in str(item)

    asyncio.run(run())
