"""The chat template that turns /v1/chat/completions messages into a prompt.

The template is `--chat-template FILE` when given, else the checkpoint's own (`chat_template` in
tokenizer_config.json). It is rendered the way transformers renders it, and the rendered text is
encoded without adding special tokens: a template writes its own BOS and turn markers.

```
 [{"role": "user", "content": "Hi"}] ──template──▶ "<s><|user|>Hi</s><|assistant|>" ──encode──▶ ids
                                      add_generation_prompt: end with the assistant's turn header
```
"""

from __future__ import annotations

from pathlib import Path

from pagedserve.frontend.tokenization.tokenizer import Tokenizer
from pagedserve.frontend.tools.tool_templates import PROBE_MESSAGES, PROBE_TOOL_NAME, PROBE_TOOLS, uses_tools
from pagedserve.contracts.sampling_params import InvalidParameter


class ChatTemplateError(ValueError):
    """--chat-template names a file that cannot be read, or a template that does not parse."""


def read_chat_template(path: str | Path) -> str:
    """The text of a --chat-template file, checked to parse as Jinja; raises ChatTemplateError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"--chat-template {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    _check_parses(text, f"--chat-template {path}")
    return text


def _check_parses(template: str, origin: str) -> None:
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{origin}: not a Jinja template: {exc}") from exc


class ChatTemplate:
    """Renders and encodes chat messages; `template` None means the checkpoint's own.
    `tools_template`: the template for messages that use tools when `template` does not render the
    Jinja `tools` variable (pagedserve.frontend.tools.tool_templates)."""

    def __init__(self, tokenizer: Tokenizer, template: str | None = None, tools_template: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.template = template if template is not None else tokenizer.chat_template
        self.tools_template = tools_template
        self._renders_tools: bool | None = None

    def renders_tools(self) -> bool:
        """Whether the template puts the Jinja `tools` it is given into the prompt."""
        if self._renders_tools is None:
            try:
                text = self._tokenizer.render_chat(PROBE_MESSAGES, self.template, True, tools=PROBE_TOOLS)
            except Exception:  # a template that cannot take tools does not render them
                text = ""
            self._renders_tools = PROBE_TOOL_NAME in text
        return self._renders_tools

    def _template_for(self, messages: list[dict], tools: list[dict] | None) -> str | None:
        if self.template is None or not uses_tools(messages, tools) or self.renders_tools():
            return self.template
        if self.tools_template is not None:
            return self.tools_template
        raise InvalidParameter("tools" if tools else "messages",
                               "the chat template of this model does not render tools, and a reply would "
                               "ignore them: start the server with --chat-template FILE (a template that "
                               "renders the Jinja `tools` variable) or with the --tool-call-parser of a model "
                               "family that has a shipped template (smollm2)")

    @property
    def is_available(self) -> bool:
        return self.template is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text of `messages` (dicts with role and content, tool_calls, tool_call_id)
        and `tools` (the Jinja `tools` variable); InvalidParameter("messages") when there is no
        template or the template refuses the messages, ("tools") when no template renders them."""
        if self.template is None:
            raise InvalidParameter(
                "messages", "this model has no chat template: start the server with --chat-template FILE, "
                "or send a prompt to /v1/completions")
        template = self._template_for(messages, tools)
        try:
            return self._tokenizer.render_chat(messages, template, add_generation_prompt, tools=tools)
        except Exception as exc:  # a template raises what it likes (raise_exception, TypeError …)
            raise InvalidParameter("messages", f"the chat template cannot render these messages: "
                                   f"{type(exc).__name__}: {exc}") from exc

    def encode(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered messages (no special tokens added: the template has them)."""
        return self._tokenizer.encode(self.render(messages, add_generation_prompt, tools), add_special_tokens=False)
