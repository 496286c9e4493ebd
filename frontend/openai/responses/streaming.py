"""The server-sent events of a streamed response, as OpenAI sends them (`event: TYPE` then
`data: {"type": TYPE, "sequence_number": N, ...}`), from the updates of a GenerationRun:

```
 response.created            {response}  status in_progress, no output yet
 response.in_progress        {response}
 response.output_item.added  {output_index 0, item}  the assistant message, no content yet
                                        (with tools: at the first content, output_index the
                                        number of items before it)
 response.content_part.added {item_id, output_index 0, content_index 0, part}  empty output_text
 response.output_text.delta  {item_id, output_index, content_index, delta}  per update with text
 response.output_text.done   {..., text}  the whole text
 response.content_part.done  {..., part}
 response.output_item.done   {output_index 0, item}  the message, status completed | incomplete
 with tools, per call, when its block closes (output_index: the next item's):
   response.output_item.added               {output_index, item}  function_call, arguments ""
   response.function_call_arguments.delta   {item_id, output_index, delta}  the whole arguments
   response.function_call_arguments.done    {item_id, output_index, arguments}
   response.output_item.done                {output_index, item}  status completed
 response.completed          {response}  with output and usage (response.incomplete when the
                                         output reached max_output_tokens)
 event: error                {"error": {...}}  a failure after the stream began; the stream ends
```

No `data: [DONE]` follows (OpenAI sends none on this endpoint).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.frontend.generation.updates import GenerationUpdate
from pagedserve.frontend.openai.bodies import total_usage
from pagedserve.frontend.openai.generation_run import GenerationRun
from pagedserve.frontend.openai.responses.function_tools import function_call_item
from pagedserve.frontend.openai.responses.objects import (
    ResponseIdentity, item_status, message_item, response_object, text_part,
)
from pagedserve.frontend.openai.responses.protocol import ResponsesRequest
from pagedserve.frontend.openai.streaming import dumps, error_frame
from pagedserve.frontend.tools.tool_parsers import ToolCall, get_parser
from pagedserve.frontend.tools.tool_stream import ToolStream


class ResponseEventWriter:
    """Numbers the events of one response and remembers the items sent. tool_parser: the
    --tool-call-parser of a request with active tools: its text goes through a ToolStream, the
    message item opens at the first content (not at the opening), and each call is an item."""

    def __init__(self, identity: ResponseIdentity, request: ResponsesRequest, params: SamplingParams, *,
                 tool_parser: str | None = None) -> None:
        self._identity = identity
        self._request = request
        self._params = params
        self._sequence_number = 0
        self._text = ""
        self._finish = None
        self._tools = None if tool_parser is None else ToolStream(get_parser(tool_parser))
        self._message_index: int | None = None  # the message item's output_index once opened
        self._items: list[dict | None] = []  # by output_index: the done item (None: the message, still open)

    def frame(self, kind: str, **fields) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"

    def _where(self) -> dict:
        return {"item_id": self._identity.message_id, "output_index": self._message_index, "content_index": 0}

    def opening(self) -> list[bytes]:
        response = response_object(self._identity, self._request, self._params, status="in_progress", output=[],
                                   usage=None)
        frames = [self.frame("response.created", response=response),
                  self.frame("response.in_progress", response=response)]
        if self._tools is None:
            frames += self._open_message()
        return frames

    def _open_message(self) -> list[bytes]:
        self._message_index = len(self._items)
        self._items.append(None)
        return [self.frame("response.output_item.added", output_index=self._message_index,
                           item=message_item(self._identity, None, "in_progress")),
                self.frame("response.content_part.added", **self._where(), part=text_part(""))]

    def _text_delta(self, text: str) -> list[bytes]:
        frames = self._open_message() if self._message_index is None else []
        self._text += text
        return frames + [self.frame("response.output_text.delta", **self._where(), delta=text, logprobs=[])]

    def _call(self, call: ToolCall) -> list[bytes]:
        """One call's item: added (no arguments yet), its arguments as one delta, done."""
        index = len(self._items)
        item = function_call_item(call)
        self._items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        return [self.frame("response.output_item.added", output_index=index,
                           item=function_call_item(call, "in_progress", arguments="")),
                self.frame("response.function_call_arguments.delta", **where, delta=call.arguments_json),
                self.frame("response.function_call_arguments.done", **where, arguments=call.arguments_json),
                self.frame("response.output_item.done", output_index=index, item=item)]

    def _tool_frames(self, deltas: list[dict]) -> list[bytes]:
        frames = []
        for delta in deltas:
            if "content" in delta:
                frames += self._text_delta(delta["content"])
        for call in self._tools.calls[sum(item is not None for item in self._items):]:
            frames += self._call(call)
        return frames

    def deltas(self, update: GenerationUpdate) -> list[bytes]:
        frames = []
        for completion in update.completions:
            if completion.index != 0:
                continue
            if self._tools is not None:
                frames += self._tool_frames(self._tools.feed(completion.text))
                if completion.finish is not None:
                    frames += self._tool_frames(self._tools.finish())
            elif completion.text:
                frames += self._text_delta(completion.text)
            if completion.finish is not None:
                self._finish = completion.finish
        return frames

    def closing(self, run: GenerationRun) -> list[bytes]:
        status = item_status(self._finish)
        frames = []
        if self._message_index is None and not self._items:  # no content and no calls: an empty message
            frames += self._open_message()
        if self._message_index is not None:
            item = message_item(self._identity, self._text, status)
            self._items[self._message_index] = item
            frames += [self.frame("response.output_text.done", **self._where(), text=self._text, logprobs=[]),
                       self.frame("response.content_part.done", **self._where(), part=text_part(self._text)),
                       self.frame("response.output_item.done", output_index=self._message_index, item=item)]
        usage = total_usage([run.usages[index] for index in sorted(run.usages)])
        response = response_object(self._identity, self._request, self._params, status=status,
                                   output=list(self._items), usage=usage)
        return frames + [self.frame("response.completed" if status == "completed" else "response.incomplete",
                                    response=response)]


async def response_events(first: tuple[int, GenerationUpdate] | None, run: GenerationRun,
                          writer: ResponseEventWriter,
                          error_body: Callable[[BaseException], dict]) -> AsyncIterator[bytes]:
    """The frames of a stream whose first update has arrived; a client that goes away cancels the
    iteration, which cancels the run."""
    try:
        for frame in writer.opening():
            yield frame
        item = first
        while item is not None:
            for frame in writer.deltas(item[1]):
                yield frame
            item = await run.next()
        for frame in writer.closing(run):
            yield frame
    except Exception as exc:  # after the status line: the error travels in the stream
        yield error_frame(error_body(exc))
    finally:
        if not run.is_finished:
            run.cancel()
