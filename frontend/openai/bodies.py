"""The JSON shapes of OpenAI responses: errors, usage, logprobs, and whole (non-streamed) answers.

Choices are numbered across prompts: with p prompts and n choices each, choice `p * n + i` is
completion i of prompt p (OpenAI's order). Beam search returns the n best beams of each prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.frontend.generation.completion_state import CompletionFinish
from pagedserve.frontend.generation.updates import Usage
from pagedserve.contracts.request_types import TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -Infinity: a masked alternative reports this (as vLLM does)


class TokenTexts:
    """Token id -> text, cached (logprobs name every token and its alternatives)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.token_text(token_id)
        return text


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def finish_reason(finish: CompletionFinish | None) -> str | None:
    """OpenAI's finish_reason: a stop string, EOS or a stop token id is `stop`."""
    if finish is None:
        return None
    return "length" if finish is CompletionFinish.LENGTH else "stop"


def total_usage(usages: Sequence[Usage]) -> Usage:
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_prompt_tokens=sum(u.cached_prompt_tokens for u in usages))


def usage_body(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def completion_logprobs(logprobs: Sequence[TokenLogprob], num_top: int, token_text: TokenTexts,
                        text_offset: int) -> dict:
    """The legacy completions `logprobs` object; offsets count from `text_offset`."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for item in logprobs:
        text = token_text(item.token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(item.logprob))
        top: dict[str, float] = {}
        for top_id, top_logprob in list(zip(item.top_token_ids, item.top_logprobs))[:num_top]:
            top.setdefault(token_text(top_id), _logprob(top_logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(logprobs: Sequence[TokenLogprob], num_top: int, token_text: TokenTexts) -> dict:
    """The chat `logprobs` object: per token its text, logprob, UTF-8 bytes and alternatives."""
    content = []
    for item in logprobs:
        text = token_text(item.token_id)
        top = [{"token": token_text(top_id), "logprob": _logprob(top_logprob),
                "bytes": list(token_text(top_id).encode("utf-8"))}
               for top_id, top_logprob in list(zip(item.top_token_ids, item.top_logprobs))[:num_top]]
        content.append({"token": text, "logprob": _logprob(item.logprob), "bytes": list(text.encode("utf-8")),
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every response and chunk of one request repeats."""

    response_id: str
    created: int
    model: str


def completion_response(header: ResponseHeader, choices: list[dict], usage: Usage) -> dict:
    return {"id": header.response_id, "object": "text_completion", "created": header.created,
            "model": header.model, "choices": choices, "usage": usage_body(usage)}


def completion_choice(index: int, text: str, finish: CompletionFinish | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(finish)}


def chat_response(header: ResponseHeader, choices: list[dict], usage: Usage) -> dict:
    return {"id": header.response_id, "object": "chat.completion", "created": header.created,
            "model": header.model, "choices": choices, "usage": usage_body(usage)}


def chat_choice(index: int, text: str | None, finish: CompletionFinish | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None) -> dict:
    """tool_calls: the parsed calls (then `text` is the content around them, None when blank)."""
    message: dict = {"role": "assistant", "content": text}
    reason = finish_reason(finish)
    if tool_calls:
        message["tool_calls"] = tool_calls
        if reason == "stop":
            reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def model_card(name: str, created: int, max_model_len: int | None, defaults=None) -> dict:
    """The model's card; `sampling_defaults` shows what a request that leaves a field out gets
    (--generation-config) and where it comes from."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "pagedserve"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    if defaults is not None:
        card["sampling_defaults"] = {**defaults.fields(), "source": defaults.source}
    return card
