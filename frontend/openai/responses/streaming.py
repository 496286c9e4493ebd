"""The server-sent events of a streamed response, as OpenAI sends them (`event: TYPE` then
`data: {"type": TYPE, "sequence_number": N, ...}`), from the updates of a GenerationRun:

```
 response.created            {response}  status in_progress, no output yet
 response.in_progress        {response}
 response.output_item.added  {output_index 0, item}  the assistant message, no content yet
 response.content_part.added {item_id, output_index 0, content_index 0, part}  empty output_text
 response.output_text.delta  {item_id, output_index, content_index, delta}  per update with text
 response.output_text.done   {..., text}  the whole text
 response.content_part.done  {..., part}
 response.output_item.done   {output_index 0, item}  the message, status completed | incomplete
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
from pagedserve.frontend.openai.responses.objects import (
    ResponseIdentity, item_status, message_item, response_object, text_part,
)
from pagedserve.frontend.openai.responses.protocol import ResponsesRequest
from pagedserve.frontend.openai.streaming import dumps, error_frame


class ResponseEventWriter:
    """Numbers the events of one response and remembers the text sent."""

    def __init__(self, identity: ResponseIdentity, request: ResponsesRequest, params: SamplingParams) -> None:
        self._identity = identity
        self._request = request
        self._params = params
        self._sequence_number = 0
        self._text = ""
        self._finish = None

    def frame(self, kind: str, **fields) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"

    def _where(self) -> dict:
        return {"item_id": self._identity.message_id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[bytes]:
        response = response_object(self._identity, self._request, self._params, status="in_progress", output=[],
                                   usage=None)
        return [self.frame("response.created", response=response),
                self.frame("response.in_progress", response=response),
                self.frame("response.output_item.added", output_index=0,
                           item=message_item(self._identity, None, "in_progress")),
                self.frame("response.content_part.added", **self._where(), part=text_part(""))]

    def deltas(self, update: GenerationUpdate) -> list[bytes]:
        frames = []
        for completion in update.completions:
            if completion.index != 0:
                continue
            if completion.text:
                self._text += completion.text
                frames.append(self.frame("response.output_text.delta", **self._where(), delta=completion.text,
                                         logprobs=[]))
            if completion.finish is not None:
                self._finish = completion.finish
        return frames

    def closing(self, run: GenerationRun) -> list[bytes]:
        status = item_status(self._finish)
        item = message_item(self._identity, self._text, status)
        usage = total_usage([run.usages[index] for index in sorted(run.usages)])
        response = response_object(self._identity, self._request, self._params, status=status, output=[item],
                                   usage=usage)
        return [self.frame("response.output_text.done", **self._where(), text=self._text, logprobs=[]),
                self.frame("response.content_part.done", **self._where(), part=text_part(self._text)),
                self.frame("response.output_item.done", output_index=0, item=item),
                self.frame("response.completed" if status == "completed" else "response.incomplete",
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
