"""GenerateRequest (public proto) -> ValidatedRequest, or InvalidParameter naming the bad field.

proto3 zeros resolve to defaults exactly as the public contract pins them: max_tokens 0 -> 16,
temperature 0 -> greedy, top_p 0 -> 1, top_k 0 -> off, repetition_penalty 0 -> 1, n 0 -> 1,
(those five, and min_p, are `optional`: unset, they take the model's default where it has one),
beam_width 0 -> 1 (no beam search), length_penalty unset -> 1.0, seed unset -> none; no constraint
oneof -> unconstrained (json_object false counts as unset).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Protocol

from pagedserve.checkpoints.generation_defaults import NEUTRAL, SamplingDefaults
from pagedserve.contracts.constraint_grammar import check_constraint
from pagedserve.contracts.request_types import AdapterRef
from pagedserve.contracts.sampling_params import DEFAULT_MAX_TOKENS, InvalidParameter, SamplingParams
from pagedserve.contracts.scheduler_codec import constraint_from_proto
from pagedserve.frontend.grpc.tool_calls import chat_message_dict, tool_request_from_proto
from pagedserve.frontend.tools.tool_request import ToolRequest, ToolSettings, forced_constraint
from pagedserve.v1 import generation_pb2

MAX_REQUEST_ID_CHARS = 256
# A text prompt is refused by its UTF-8 length before it is tokenized (tokenizing tens of MB takes
# minutes and gigabytes): no tokenizer spends more than this many bytes per token in practice, so a
# prompt longer than max_model_len x MAX_BYTES_PER_TOKEN cannot fit; short contexts get a floor.
MAX_BYTES_PER_TOKEN = 16
MIN_MAX_PROMPT_BYTES = 64 * 1024


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ChatEncoder(Protocol):
    def encode(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int  # prompt and stop token ids must be below it

    @property
    def max_prompt_bytes(self) -> int:
        """The longest text (UTF-8 bytes) worth tokenizing; longer prompts are refused unread."""
        return max_prompt_bytes(self.max_model_len)


def max_prompt_bytes(max_model_len: int) -> int:
    return max(max_model_len * MAX_BYTES_PER_TOKEN, MIN_MAX_PROMPT_BYTES)


def check_text_bytes(field_name: str, texts: list[str], max_bytes: int) -> None:
    """Raises InvalidParameter when `texts` together are longer than `max_bytes` UTF-8 bytes.
    Characters are counted first (1 to 4 bytes each): only texts between max_bytes / 4 and
    max_bytes characters are encoded to count their bytes."""
    num_chars = sum(len(text) for text in texts)
    if num_chars <= max_bytes // 4:
        return
    if num_chars > max_bytes:
        num_bytes, qualifier = num_chars, "at least "
    else:
        num_bytes, qualifier = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts), ""
    if num_bytes > max_bytes:
        raise InvalidParameter(
            field_name, f"{qualifier}{num_bytes} bytes of text; at most {max_bytes} are accepted "
            f"(max_model_len x {MAX_BYTES_PER_TOKEN} bytes per token)")


@dataclass(slots=True)
class ValidatedRequest:
    request_id: str  # the client's, or generated; also the scheduler's id for the request
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first under the scheduler's --scheduling-policy priority
    tools: ToolRequest | None = None  # a chat request with tools (tool_choice none included)
    adapter: AdapterRef | None = None  # the LoRA adapter the request names (None: the base model)


def sampling_params_from_proto(msg: generation_pb2.SamplingParams,
                               defaults: SamplingDefaults = NEUTRAL) -> SamplingParams:
    """Resolves proto3 zeros to defaults; does not validate. The optional sampling fields
    (temperature, top_p, top_k, min_p, repetition_penalty) left unset take the model's default
    (`defaults`, --generation-config) where it has one, else the proto3 zero's meaning; a value set,
    0 included, is the request's (beam search takes no sampling defaults)."""
    if msg.beam_width > 1:
        defaults = NEUTRAL

    def optional(name: str):
        return getattr(msg, name) if msg.HasField(name) else getattr(defaults, name)

    temperature, top_p, top_k = optional("temperature"), optional("top_p"), optional("top_k")
    min_p, repetition_penalty = optional("min_p"), optional("repetition_penalty")
    return SamplingParams(
        max_tokens=msg.max_tokens or DEFAULT_MAX_TOKENS,
        min_tokens=msg.min_tokens,
        temperature=temperature or 0.0,
        top_p=top_p or 1.0,
        top_k=top_k or 0,
        min_p=min_p or 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        n=msg.n or 1,
        beam_width=msg.beam_width or 1,
        length_penalty=msg.length_penalty if msg.HasField("length_penalty") else 1.0,
        logprobs=msg.logprobs,
        constraint=constraint_from_proto(msg),
        logit_bias=dict(msg.logit_bias),
    )


def validate_request(msg: generation_pb2.GenerateRequest, encoder: Encoder, limits: ModelLimits,
                     chat: ChatEncoder | None = None, tool_settings: ToolSettings = ToolSettings(),
                     defaults: SamplingDefaults = NEUTRAL) -> ValidatedRequest:
    """Checks every field and tokenizes a text prompt (or renders chat messages with `chat`, and
    the tools); raises InvalidParameter naming the field."""
    request_id = request_id_or_new(msg.request_id)
    params = sampling_params_from_proto(msg.params, defaults)
    tools = tool_request_from_proto(msg, tool_settings)
    if tools is not None and tools.is_forced:
        if params.constraint is not None:
            raise InvalidParameter("tool_choice", f"a forced tool call cannot be combined with the constraint "
                                                  f"{params.constraint.field_name}")
        params = replace(params, constraint=forced_constraint(tools, tool_settings.parser))
    params.validate(vocab_size=limits.vocab_size)
    if params.constraint is not None:
        check_constraint(params.constraint)  # compiles (without the vocabulary) before anything is queued
    template_tools = tools.template_tools() if tools is not None and tools.is_active else None
    prompt_field, prompt_token_ids = _prompt(msg, encoder, limits, chat, template_tools)
    defaulted = " (max_tokens 0 means 16)" if msg.params.max_tokens == 0 else ""
    return validate_lengths(ValidatedRequest(request_id, prompt_token_ids, params, msg.priority, tools), limits,
                            prompt_field, max_tokens_field="max_tokens", max_tokens_note=defaulted)


def validate_lengths(request: ValidatedRequest, limits: ModelLimits, prompt_field: str, *,
                     max_tokens_field: str = "max_tokens", max_tokens_note: str = "") -> ValidatedRequest:
    """Checks that prompt and completion fit max_model_len (the parameters are validated already);
    returns `request`. The field names are the ones the client used (they differ by protocol)."""
    num_prompt_tokens = len(request.prompt_token_ids)
    if num_prompt_tokens >= limits.max_model_len:
        raise InvalidParameter(
            prompt_field,
            f"the prompt has {num_prompt_tokens} tokens; max_model_len is {limits.max_model_len} "
            "(prompt and completion together)",
        )
    max_tokens = request.params.max_tokens
    if num_prompt_tokens + max_tokens > limits.max_model_len:
        raise InvalidParameter(
            max_tokens_field,
            f"prompt ({num_prompt_tokens} tokens) + {max_tokens_field} ({max_tokens}){max_tokens_note} exceeds "
            f"max_model_len {limits.max_model_len}; at most {limits.max_model_len - num_prompt_tokens} "
            "tokens can be generated",
        )
    return request


def check_token_ids(field_name: str, token_ids: list[int], vocab_size: int) -> None:
    """Raises InvalidParameter when a prompt token id is outside the vocabulary."""
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidParameter(
                field_name,
                f"token id {token_id} at position {position} is outside the vocabulary (size {vocab_size})",
            )


def request_id_or_new(client_id: str) -> str:
    """The client's id (it must be unique among running requests), or a fresh one."""
    if not client_id:
        return uuid.uuid4().hex
    if len(client_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidParameter("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
    if not is_printable_ascii(client_id):
        raise InvalidParameter("request_id", "only printable ASCII characters (no control characters); "
                               "it is echoed in metadata and written to logs")
    return client_id


def is_printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _prompt(msg: generation_pb2.GenerateRequest, encoder: Encoder, limits: ModelLimits,
            chat: ChatEncoder | None, tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """(field name, prompt token ids) of whichever prompt field is set."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidParameter("prompt", "set exactly one of prompt, prompt_token_ids or messages")
    if which == "messages":
        return "messages", _chat_prompt(msg.messages, chat, limits.max_prompt_bytes, tools)
    if which == "prompt":
        if not msg.prompt:
            raise InvalidParameter("prompt", "must not be empty")
        check_text_bytes("prompt", [msg.prompt], limits.max_prompt_bytes)
        token_ids = encoder.encode(msg.prompt)
        if not token_ids:
            raise InvalidParameter("prompt", "encodes to no tokens")
        return "prompt", token_ids
    token_ids = list(msg.prompt_token_ids.ids)
    if not token_ids:
        raise InvalidParameter("prompt_token_ids", "must not be empty")
    check_token_ids("prompt_token_ids", token_ids, limits.vocab_size)
    return "prompt_token_ids", token_ids


def _chat_prompt(msg: generation_pb2.ChatMessages, chat: ChatEncoder | None, max_bytes: int,
                 tools: list[dict] | None = None) -> list[int]:
    if not msg.messages:
        raise InvalidParameter("messages", "must not be empty")
    check_text_bytes("messages", [text for m in msg.messages for text in (m.role, m.content)], max_bytes)
    for index, message in enumerate(msg.messages):
        if not message.role:
            raise InvalidParameter("messages", f"message {index} has no role")
    if chat is None:
        raise InvalidParameter("messages", "this frontend renders no chat messages")
    add_generation_prompt = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    messages = [chat_message_dict(m, index) for index, m in enumerate(msg.messages)]
    token_ids = chat.encode(messages, add_generation_prompt, tools) if tools else \
        chat.encode(messages, add_generation_prompt)
    if not token_ids:
        raise InvalidParameter("messages", "render to no tokens")
    return token_ids
