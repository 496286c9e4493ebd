"""The JSON objects of the Responses API: the response, its output items (message, function
calls), its usage."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.frontend.generation.completion_state import CompletionFinish
from pagedserve.frontend.generation.updates import Usage
from pagedserve.frontend.openai.responses.function_tools import function_call_item
from pagedserve.frontend.openai.responses.protocol import ResponsesRequest
from pagedserve.frontend.tools.tool_parsers import get_parser
from pagedserve.frontend.tools.tool_stream import message_content


@dataclass(frozen=True, slots=True)
class ResponseIdentity:
    """What every object and event of one response repeats."""

    response_id: str  # resp_<request id>
    message_id: str  # msg_<request id>, the one output message
    created_at: int
    model: str


def usage_object(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(identity: ResponseIdentity, text: str | None, status: str) -> dict:
    """The assistant's output message; text None: no content part yet (a stream's opening)."""
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": identity.message_id, "status": status, "role": "assistant", "content": content}


def output_items(identity: ResponseIdentity, text: str, status: str, tool_parser: str | None) -> list[dict]:
    """A whole answer's output: the message; with tools (`tool_parser`), the message when there is
    content around the calls, then one function_call item per call."""
    if tool_parser is None:
        return [message_item(identity, text, status)]
    parsed = get_parser(tool_parser).parse(text)
    content = message_content(parsed)
    items = [] if content is None else [message_item(identity, content, status)]
    return items + [function_call_item(call) for call in parsed.calls]


def item_status(finish: CompletionFinish | None) -> str:
    return "incomplete" if finish is CompletionFinish.LENGTH else "completed"


def response_object(identity: ResponseIdentity, request: ResponsesRequest, params: SamplingParams, *,
                    status: str, output: list[dict], usage: Usage | None) -> dict:
    """The response; status in_progress (a stream's opening), completed or incomplete (the
    output reached max_output_tokens, or the context's end)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": identity.response_id, "object": "response", "created_at": identity.created_at, "status": status,
        "background": False, "error": None, "incomplete_details": incomplete, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "max_tool_calls": None, "model": identity.model,
        "output": output, "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": False,
        "temperature": params.temperature, "text": {"format": request.text_format, "verbosity": "medium"},
        "tool_choice": request.tool_choice, "tools": request.tools, "top_logprobs": 0, "top_p": params.top_p,
        "truncation": "disabled", "usage": None if usage is None else usage_object(usage), "user": request.user,
        "metadata": request.metadata,
    }
