"""A request's unread output in the scheduler is bounded in bytes: past the cap the request is
aborted once, what was queued is dropped, and the stream reads OutputOverflow. A held request's
outputs (hold_output) go out as its first and then merged, saying what the plain ones say."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.contracts.request_types import CompletionDelta, FinishReason, RequestOutput, TokenLogprob
from pagedserve.scheduler.undelivered_output import HOLD_MAX_TOKENS, Delivery, OutputOverflow, UndeliveredOutput


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


def _drain(outputs: UndeliveredOutput) -> list:
    items = []
    while not outputs._queue.empty():
        items.append(asyncio.run(outputs.get()))
    return items


def _step(deltas: list[CompletionDelta], is_finished: bool = False) -> RequestOutput:
    return RequestOutput("r", deltas, prompt_tokens=3, cached_prompt_tokens=16, is_finished=is_finished)


def test_held_output_sends_the_first_at_once_and_the_rest_merged_at_the_end():
    """n = 2 with logprobs: what the held request sends, joined, is what a plain one sends."""
    steps = [
        _step([CompletionDelta(0, [5], [TokenLogprob(5, -0.5)], -0.5),
               CompletionDelta(1, [6], [TokenLogprob(6, -1.0)], -1.0)]),
        _step([CompletionDelta(0, [7], [TokenLogprob(7, -0.25)], -0.75),
               CompletionDelta(1, [8], [TokenLogprob(8, -0.5)], -1.5, FinishReason.STOP)]),
        _step([CompletionDelta(0, [9, 10], [TokenLogprob(9, -0.125), TokenLogprob(10, -0.125)], -1.0)]),
        _step([CompletionDelta(0, [11], [TokenLogprob(11, -1.0)], -2.0, FinishReason.LENGTH)], is_finished=True),
    ]
    plain, held = UndeliveredOutput(1 << 20, pytest.fail), UndeliveredOutput(1 << 20, pytest.fail, hold=True)
    for step in steps:
        plain.put(step)
        held.put(step)
        if not step.is_finished:
            assert held._queue.qsize() == 1  # the first output only, until the request finishes
    sent_plain, sent_held = _drain(plain), _drain(held)
    assert len(sent_plain) == 4 and len(sent_held) == 2
    assert sent_held[0].output is steps[0]

    def joined(deliveries) -> dict:
        completions = {}
        for delivery in deliveries:
            for delta in delivery.message.deltas:
                entry = completions.setdefault(delta.index, {"tokens": [], "logprobs": []})
                entry["tokens"] += list(delta.token_ids)
                entry["logprobs"] += [(lp.token_id, lp.logprob) for lp in delta.logprobs]
                entry["cumulative"], entry["finish"] = delta.cumulative_logprob, delta.finish_reason or entry.get("finish")
        return completions

    assert joined(sent_held) == joined(sent_plain)
    assert joined(sent_held)[0]["tokens"] == [5, 7, 9, 10, 11]
    last = sent_held[-1].message
    assert last.is_finished and last.prompt_tokens == 3 and last.cached_prompt_tokens == 16
    assert [delta.index for delta in last.deltas] == [0, 1]
    assert steps[1].deltas[0].token_ids == [7]  # the engine's outputs are not changed by the merge


def test_held_output_goes_out_every_hold_max_tokens_and_before_an_error():
    held = UndeliveredOutput(1 << 20, pytest.fail, hold=True)
    for _ in range(1 + HOLD_MAX_TOKENS):
        held.put(_output(1))
    sent = _drain(held)
    assert [sum(len(d.token_ids) for d in item.message.deltas) for item in sent] == [1, HOLD_MAX_TOKENS]
    held.put(_output(1))
    held.put(_output(1))
    error = RuntimeError("workers lost")
    held.put(error)
    sent = _drain(held)
    assert len(sent) == 2 and list(sent[0].message.deltas[0].token_ids) == [0, 0] and sent[1] is error


def test_a_session_takes_what_is_ready_in_order_up_to_its_byte_budget_and_hears_of_each_output():
    async def run() -> None:
        ready = []
        outputs = UndeliveredOutput(10_000, lambda: pytest.fail("aborted"), on_ready=lambda: ready.append(True))
        for num_tokens in (10, 20, 30):
            outputs.put(_output(num_tokens))
        assert len(ready) == 3
        sizes = [outputs.num_bytes]
        first, num_bytes = outputs.take_ready(1)  # the first output whatever its size, then nothing more
        assert [len(item.message.deltas[0].token_ids) for item in first] == [10]
        assert num_bytes == first[0].num_bytes and outputs.has_ready
        rest, rest_bytes = outputs.take_ready(10_000)
        assert [len(item.message.deltas[0].token_ids) for item in rest] == [20, 30]
        assert num_bytes + rest_bytes == sizes[0] and outputs.num_bytes == 0 and not outputs.has_ready
        outputs.put(RuntimeError("the engine stopped"))  # an end is taken like an output, with no bytes
        assert len(ready) == 4
        (end,), end_bytes = outputs.take_ready(10_000)
        assert isinstance(end, RuntimeError) and end_bytes == 0

    asyncio.run(run())
