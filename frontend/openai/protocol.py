"""OpenAI request bodies -> our SamplingParams, or InvalidParameter naming the field (`param`).

Bodies are parsed as JSON by the HTTP layer, then checked here with strict pydantic models (a
string is not a number, 1 is not `true`). An OpenAI or vLLM field we do not serve is refused
(request_fields.py); a field nobody defines is logged with the request id, as vLLM does. What the
OpenAI API and vLLM's extensions mean in our terms:

```
 OpenAI / vLLM field                    SamplingParams                 notes
 max_completion_tokens | max_tokens     max_tokens                     the former wins; default 16
                                                                       (completions) or the rest of
                                                                       the context (chat)
 temperature, top_p, top_k, min_p,      the same                       left out: the model's default
   repetition_penalty                                                  (--generation-config), else
                                                                       OpenAI's (temperature, top_p 1)
                                                                       and off; beam search: neutral
 n, seed, stop, presence_penalty,       the same
   frequency_penalty, top_k -1 (off),
   min_tokens,
   ignore_eos, include_stop_str_in_output,
   stop_token_ids
 logprobs (completions: int k;          logprobs = max(1, k)           k alternatives are returned
   chat: true + top_logprobs k)
 use_beam_search + best_of, length_pen. beam_width = max(n, best_of)   the n best beams returned
 best_of without beam search            1 or null only
 logit_bias                             logit_bias                     {"id": bias}, bias in [-100, 100]
 response_format, structured_outputs,   constraint                     structured_output.py
   guided_json/regex/choice/grammar
 priority                               priority                       int32, lower first (scheduler
                                                                       --scheduling-policy priority)
 user                                   -                              logged
```
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedserve.checkpoints.generation_defaults import NEUTRAL, SamplingDefaults
from pagedserve.contracts.sampling_params import MAX_LOGPROBS, InvalidParameter, SamplingParams
from pagedserve.frontend.openai.request_fields import check_fields
from pagedserve.frontend.openai.structured_output import parse_constraint, parse_logit_bias
from pagedserve.frontend.tools.tool_request import (
    ToolRequest, ToolSettings, forced_constraint, history_tool_calls, parse_tool_request,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS = 64  # prompts of one /v1/completions request
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# How the fields whose value may take several shapes are described in errors.
_EXPECTED = {
    "prompt": "a string, an array of strings, an array of token ids or an array of arrays of token ids",
    "stop": "a string or an array of strings",
    "content": "a string or an array of content parts",
}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far


class _GenerationBody(_Body):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    # structured output (structured_output.py): checked there, so any JSON shape passes here
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    stop_token_ids: list[int] | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    priority: int | None = None


class CompletionBody(_GenerationBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant
    tool_call_id: str | None = None  # tool


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    tools: Any = None  # checked by pagedserve.frontend.tools.tool_request
    tool_choice: Any = None
    parallel_tool_calls: Any = None


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


@dataclass(slots=True)
class GenerationPlan:
    """What one OpenAI request asks for, in our terms."""

    params: SamplingParams  # max_tokens still unresolved when `max_tokens` is None
    max_tokens: int | None  # None: as many as the context leaves (chat's default)
    max_tokens_field: str  # the field the client set (or would set) the limit with
    num_choices: int  # choices per prompt (beam search: the n best beams)
    num_top_logprobs: int | None  # alternatives to return per token; None: no logprobs
    is_stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    echo: bool = False
    user: str | None = None
    priority: int = 0  # lower is served first under the scheduler's --scheduling-policy priority
    tools: ToolRequest | None = None  # chat with tools (tool_choice none included)
    param_names: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> OpenAI field

    def resolve(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """The sampling parameters of one prompt, max_tokens resolved and validated."""
        if self.max_tokens is not None:
            return replace(self.params)
        return replace(self.params, max_tokens=max(1, max_model_len - num_prompt_tokens))

    def rename(self, exc: InvalidParameter) -> InvalidParameter:
        """The error with its field named as the client named it."""
        name = self.param_names.get(exc.field_name)
        if name is None:
            return exc
        message = str(exc).split(": ", 1)[1] if ": " in str(exc) else str(exc)
        return InvalidParameter(name, message)


def parse_body(model_class: type[_Body], body: Any) -> Any:
    """`body` (parsed JSON) as `model_class`; InvalidParameter naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidParameter("body", "the request body must be a JSON object")
    try:
        return model_class.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def unknown_fields(model_class: type[_Body], body: dict) -> list[str]:
    """The body's fields nobody defines (to log); InvalidParameter for an OpenAI or vLLM field
    this server does not serve (request_fields.py)."""
    return check_fields(body, set(model_class.model_fields), is_chat=model_class is ChatCompletionBody)


def _invalid(exc: ValidationError) -> InvalidParameter:
    first = exc.errors()[0]
    param = _param_path(first["loc"])
    if first["type"] == "missing":
        return InvalidParameter(param, "is required")
    leaf = param.rsplit(".", 1)[-1]
    if leaf in _EXPECTED and len(exc.errors()) > 1:
        return InvalidParameter(param, f"must be {_EXPECTED[leaf]}")
    return InvalidParameter(param, first["msg"][0].lower() + first["msg"][1:])


def _param_path(loc: tuple) -> str:
    """('messages', 0, 'content', 'list[TextPart]', 1, 'text') -> 'messages[0].content[1].text';
    pydantic's union member tags ('str', 'list[int]' …) are left out."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper() or "-" in part:
            continue
        else:
            path += f".{part}" if path else part
    return path or "body"


def _check_int(name: str, value: int, low: int, high: int = INT32_MAX) -> None:
    if not low <= value <= high:
        raise InvalidParameter(name, f"must be in [{low}, {high}]")


def generation_plan(body: CompletionBody | ChatCompletionBody, defaults: SamplingDefaults = NEUTRAL, *,
                    tool_settings: ToolSettings = ToolSettings()) -> GenerationPlan:
    """The plan of a parsed body; raises InvalidParameter for what we do not serve. `defaults`:
    the model's, for the sampling fields the body leaves out (not with beam search)."""
    is_chat = isinstance(body, ChatCompletionBody)
    _refuse_unsupported(body, is_chat)
    tools = parse_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, tool_settings) \
        if is_chat else None
    constraint = parse_constraint(body)
    if tools is not None and tools.is_forced:
        if constraint is not None:
            raise InvalidParameter("tool_choice", f"a forced tool call cannot be combined with another "
                                                  f"constraint ({constraint.field_name})")
        constraint = forced_constraint(tools, tool_settings.parser)
    max_tokens_field = "max_completion_tokens" if is_chat and body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if is_chat and body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None and not is_chat:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    if max_tokens is not None:
        _check_int(max_tokens_field, max_tokens, 1)
    n = 1 if body.n is None else body.n
    _check_int("n", n, 1)
    is_beam_search = bool(body.use_beam_search)
    best_of = body.best_of
    if best_of is not None:
        _check_int("best_of", best_of, 1)
        if best_of > 1 and not is_beam_search:
            raise InvalidParameter("best_of", "only 1 is supported without use_beam_search (no best-of sampling)")
        if best_of < n:
            raise InvalidParameter("best_of", "must be at least n")
    if is_beam_search:
        defaults = NEUTRAL  # beam search is deterministic: no sampling defaults
    top_k = body.top_k
    if top_k is None:
        top_k = defaults.top_k or 0
    top_k = 0 if top_k == -1 else top_k
    _check_int("top_k", top_k, 0)
    min_tokens = body.min_tokens or 0
    _check_int("min_tokens", min_tokens, 0)
    num_top_logprobs, logprobs_field = _logprobs(body, is_chat)
    beam_width = max(n, best_of or 1) if is_beam_search else 1
    temperature = _or_default(body.temperature, defaults.temperature, 0.0 if is_beam_search else 1.0)
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        min_tokens=min_tokens,
        temperature=temperature,
        top_p=_or_default(body.top_p, defaults.top_p, 1.0),
        top_k=top_k,
        min_p=_or_default(body.min_p, defaults.min_p, 0.0),
        seed=body.seed,
        repetition_penalty=_or_default(body.repetition_penalty, defaults.repetition_penalty, 1.0),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=bool(body.ignore_eos),
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        n=1 if is_beam_search else n,
        beam_width=beam_width,
        length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
        logprobs=0 if num_top_logprobs is None else max(1, num_top_logprobs),
        constraint=constraint,
        logit_bias=parse_logit_bias(body.logit_bias),
    )
    include_usage = continuous_usage = False
    if body.stream_options is not None:
        if not body.stream:
            raise InvalidParameter("stream_options", "only allowed when stream is true")
        include_usage = bool(body.stream_options.include_usage)
        continuous_usage = bool(body.stream_options.continuous_usage_stats)
    return GenerationPlan(
        params=params, max_tokens=max_tokens, max_tokens_field=max_tokens_field, num_choices=n,
        num_top_logprobs=num_top_logprobs, is_stream=bool(body.stream), include_usage=include_usage,
        continuous_usage=continuous_usage, echo=bool(getattr(body, "echo", False)), user=body.user, priority=body.priority or 0, tools=tools,
        param_names={"max_tokens": max_tokens_field, "beam_width": "use_beam_search", "logprobs": logprobs_field,
                     "n": "n"})


def _or_default(value, model_default, neutral):
    """The request's value, else the model's default, else the protocol's neutral one."""
    if value is not None:
        return value
    return neutral if model_default is None else model_default


def _logprobs(body, is_chat: bool) -> tuple[int | None, str]:
    """(alternatives to return per token or None, the field to blame)."""
    if is_chat:
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise InvalidParameter("top_logprobs", "needs logprobs: true")
            _check_int("top_logprobs", body.top_logprobs, 0, MAX_LOGPROBS)
        if not body.logprobs:
            return None, "logprobs"
        return body.top_logprobs or 0, "top_logprobs"
    if body.logprobs is None:
        return None, "logprobs"
    _check_int("logprobs", body.logprobs, 0, MAX_LOGPROBS)
    if body.echo:
        raise InvalidParameter("logprobs", "cannot be combined with echo: prompt logprobs are not computed")
    return body.logprobs, "logprobs"


def _refuse_unsupported(body, is_chat: bool) -> None:
    if body.priority is not None:
        _check_int("priority", body.priority, INT32_MIN)
    if not body.use_beam_search and body.length_penalty is not None and body.length_penalty != 1.0:
        raise InvalidParameter("length_penalty", "only applies with use_beam_search")
    if not is_chat and body.suffix:
        raise InvalidParameter("suffix", "is not supported")


def prompts_of(body: CompletionBody) -> list[str | list[int]]:
    """The prompts of a completions body: texts or token id lists, at most MAX_PROMPTS."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif not prompt:
        raise InvalidParameter("prompt", "must not be empty")
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidParameter("prompt", f"at most {MAX_PROMPTS} prompts in one request")
    for index, item in enumerate(prompts):
        if len(item) == 0:
            raise InvalidParameter("prompt" if len(prompts) == 1 else f"prompt[{index}]", "must not be empty")
    return prompts


def chat_messages(messages: list[ChatMessage], field_name: str = "messages") -> list[dict]:
    """Messages as the chat template takes them: role and content text (text parts joined with
    newlines, as vLLM joins them), an assistant's tool_calls and a tool message's tool_call_id."""
    if not messages:
        raise InvalidParameter(field_name, "must not be empty")
    rendered = []
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidParameter(f"{field_name}[{index}].role", f"must be one of {', '.join(CHAT_ROLES)}")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidParameter(f"{field_name}[{index}].content[{part_index}]",
                                           "only text content parts ({\"type\": \"text\", \"text\": …}) are supported")
                texts.append(part.text)
            content = "\n".join(texts)
        item = {"role": message.role, "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls is not None:
            if message.role != "assistant":
                raise InvalidParameter(f"{field_name}[{index}].tool_calls", "only assistant messages carry tool calls")
            item["tool_calls"] = history_tool_calls(message.tool_calls, f"{field_name}[{index}].tool_calls")
        if message.role == "tool":
            if not message.tool_call_id:
                raise InvalidParameter(f"{field_name}[{index}].tool_call_id", "is required in a tool message")
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered

