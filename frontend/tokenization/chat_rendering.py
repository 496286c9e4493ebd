"""Chat templates rendered as transformers' apply_chat_template renders them (tokenize=False),
without importing transformers.

The same Jinja environment: a sandbox that cannot change its inputs, `trim_blocks` and
`lstrip_blocks`, loop controls (`break`, `continue`), `{% generation %}` blocks (rendered as
their body), the `tojson` filter of `json.dumps` (no HTML escaping; indent, separators and
sort_keys as arguments), and the globals `raise_exception`, `strftime_now`, `dict` and
`namespace` (no underscore-prefixed attributes). The same variables: `messages` (each message's
keys whose value is None dropped, the reasoning's older names aliased), `tools`, `documents`
(None), `add_generation_prompt`, and the named special tokens (`bos_token`, `eos_token`, ...).
tests/frontend/test_plain_tokenizer.py renders the shipped and the test templates both ways.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


def _generation_extension():
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}`: the body as it is (transformers marks where the
        assistant's text lies with it, for training masks only)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlock


@lru_cache(maxsize=16)
def compile_template(template: str):
    """The template compiled in transformers' chat environment (jinja2 errors propagate)."""
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment.from_string(template)


def plain_data(value):
    """JSON-shaped data rebuilt from plain types (anything else becomes "<TypeName>")."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(template: str, messages: list[dict], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = False, special_tokens: Mapping[str, str] | None = None) -> str:
    """The prompt text of one conversation under `template`."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages should be dicts, not {message!r}")
        kept = plain_data({key: value for key, value in message.items() if value is not None})
        chat.append(_with_reasoning_aliases(kept))
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise ValueError("tools should be JSON schemas")
    return compile_template(template).render(messages=chat, tools=plain_data(tools), documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **plain_data(dict(special_tokens or {})))
