"""POST /v1/responses: parse (protocol.py), run as one chat completion, answer as a response
object (objects.py) or as the Responses events (streaming.py). Stateless: nothing is stored.

The chat-completions serving does the work every endpoint shares (limits, chat template,
tokens, validation, the run, disconnects, write timeouts); errors name the Responses fields
(`max_output_tokens`, `text.format`, `input`), not the chat ones they were checked as.
"""

from __future__ import annotations

import asyncio
import time

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.openai.bodies import total_usage
from pagedserve.frontend.openai.errors import error_parts, error_response
from pagedserve.frontend.openai.generation_run import GenerationRun
from pagedserve.frontend.openai.protocol import generation_plan
from pagedserve.frontend.openai.responses.objects import (
    ResponseIdentity, item_status, output_items, response_object,
)
from pagedserve.frontend.openai.responses.protocol import ResponsesRequest, parse_responses
from pagedserve.frontend.openai.responses.streaming import ResponseEventWriter, response_events
from pagedserve.frontend.openai.serving import (
    PROTOCOL, BodyReader, ClientGone, OpenAIServing, cancel_unless_finished, unless_disconnected,
)
from pagedserve.frontend.openai.streaming import WatchedStreamingResponse

# chat-completions field (as an error names it) -> the Responses field the client sent
RESPONSES_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                   "response_format": "text.format", "json_schema": "text.format.schema", "messages": "input"}


class ResponsesServing:
    def __init__(self, chat: OpenAIServing) -> None:
        self._chat = chat

    async def responses(self, request: Request, read_body: BodyReader, request_id: str) -> Response:
        chat = self._chat
        timer = chat.metrics.start_request(PROTOCOL)
        loop = asyncio.get_running_loop()
        try:
            parsed = parse_responses(await read_body())
            chat.check_model(parsed.chat.model)
            try:
                plan = generation_plan(parsed.chat, chat.sampling_defaults, tool_settings=chat.tool_settings)
                prepared = await loop.run_in_executor(chat.executor, chat.prepare, parsed.chat, plan, request_id, True)
            except InvalidParameter as exc:
                raise _renamed(exc) from None
            run = chat.start_run(prepared, timer, loop, whole=not parsed.is_stream)
        except Exception as exc:
            return chat.refused(exc, timer)
        params = prepared.requests[0].params
        parser_name = chat.tool_parser_name(plan)
        identity = ResponseIdentity(f"resp_{request_id}", f"msg_{request_id}", int(time.time()),
                                    chat.served_model_name)
        try:
            if parsed.is_stream:
                first = await unless_disconnected(request, run.next())
                writer = ResponseEventWriter(identity, parsed, params, tool_parser=parser_name)
                return WatchedStreamingResponse(
                    response_events(first, run, writer, lambda exc: error_parts(exc)[1]),
                    media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    background=BackgroundTask(cancel_unless_finished, run),
                    write_timeout_s=chat.stream_write_timeout_s, on_timeout=chat.on_write_timeout(run, request_id))
            await unless_disconnected(request, run.collect())
            return JSONResponse(_whole(identity, parsed, params, run, parser_name))
        except ClientGone:
            run.cancel()
            return Response(status_code=499)
        except Exception as exc:
            run.cancel()
            return error_response(exc)


def _whole(identity: ResponseIdentity, parsed: ResponsesRequest, params, run: GenerationRun,
           parser_name: str | None) -> dict:
    (generation,) = run.generations
    state = min(generation.states, key=lambda state: state.index)
    status = item_status(state.finish)
    usage = total_usage([run.usages[index] for index in sorted(run.usages)])
    return response_object(identity, parsed, params, status=status,
                           output=output_items(identity, state.text, status, parser_name), usage=usage)


def _renamed(exc: InvalidParameter) -> InvalidParameter:
    """The error naming the Responses field the client sent."""
    head, _, rest = exc.field_name.partition(".")
    head, bracket, index = head.partition("[")
    name = RESPONSES_NAMES.get(head)
    if name is None:
        return exc
    message = str(exc).split(": ", 1)[1] if ": " in str(exc) else str(exc)
    return InvalidParameter(name + (bracket + index if bracket else "") + ("." + rest if rest else ""), message)
