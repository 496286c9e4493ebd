"""Request fields of the OpenAI API and vLLM's extensions that pagedserve does not serve: refused
with 400 naming the field unless the value asks for nothing (null, or the value that is already
pagedserve's behaviour). A field that neither OpenAI nor vLLM defines is logged with the request
id (vLLM's behaviour) and otherwise ignored.

`user`, `safety_identifier` and `prompt_cache_key` are identifiers and hints with nothing to
serve: accepted (prefix caching is automatic).
"""

from __future__ import annotations

from typing import Any

from pagedserve.contracts.sampling_params import InvalidParameter

# field -> the values that ask for nothing beyond what pagedserve does anyway (null always does)
_UNSERVED_BOTH: dict[str, tuple] = {
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "prompt_logprobs": (), "allowed_token_ids": (), "bad_words": ([],), "logits_processors": (),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "cache_salt": (),
    "kv_transfer_params": (), "vllm_xargs": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "structural_tag": (), "request_id": (), "service_tier": ("auto", "default"), "store": (False,),
    "metadata": ({},), "mm_processor_kwargs": (), "guided_json_object": (False,),
}
_UNSERVED_CHAT: dict[str, tuple] = {
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "verbosity": (),
    "web_search_options": (), "functions": ([],), "function_call": ("none",),
    "echo": (False,), "continue_final_message": (False,), "documents": (), "chat_template": (),
    "chat_template_kwargs": ({},), "add_special_tokens": (False,),
}
_UNSERVED_COMPLETIONS: dict[str, tuple] = {"add_special_tokens": (True,)}
_ACCEPTED = ("safety_identifier", "prompt_cache_key")


def check_fields(body: dict[str, Any], served: set[str], is_chat: bool) -> list[str]:
    """Raises InvalidParameter for the first unserved field that asks for something; returns the
    fields nobody defines (to log)."""
    unserved = {**_UNSERVED_BOTH, **(_UNSERVED_CHAT if is_chat else _UNSERVED_COMPLETIONS)}
    unknown = []
    for name, value in body.items():
        if name in served or name in _ACCEPTED:
            continue
        if name in unserved:
            if value is not None and not any(value == no_op and type(value) is type(no_op)
                                             for no_op in unserved[name]):
                raise InvalidParameter(name, "is not supported by this server")
            continue
        unknown.append(name)
    return unknown
