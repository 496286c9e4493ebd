"""A checkpoint's tokenizer read with the `tokenizers` library alone, where transformers would use
that same Rust tokenizer unchanged.

transformers' AutoTokenizer imports transformers and torch (seconds of CPU at every frontend start,
and torch's memory in a process that never runs a model). For a folder whose
tokenizer_config.json names the generic fast class (`PreTrainedTokenizerFast`, or
`TokenizersBackend` as transformers 5 saves one, a GGUF model's converted tokenizer included),
AutoTokenizer builds its tokenizer from tokenizer.json and changes it only in the cases
`plain_tokenizer_refusal` lists. Outside them, this module loads tokenizer.json itself and offers
the calls the frontend makes, with transformers' results:

    encode(text, add_special_tokens)       the Rust tokenizer's encode, truncation and padding off
    decode(ids, skip_special_tokens)       the Rust tokenizer's decode (no clean-up of spaces)
    apply_chat_template(messages, ...)     Jinja as transformers renders it (chat_rendering.py)
    len(tokenizer), bos_token_id, eos_token_id, chat_template

Any other folder (a model-specific tokenizer class, a slow tokenizer, several chat templates)
goes to transformers, as before: `load_plain_tokenizer` answers None with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pagedserve.frontend.tokenization.chat_rendering import render_chat

PLAIN_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                            "mask_token")  # transformers' named special tokens, in its order
ADDED_TOKEN_FIELDS = ("content", "special", "lstrip", "rstrip", "normalized", "single_word")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def plain_tokenizer_refusal(folder: Path, config: dict, added: dict[int, dict]) -> str | None:
    """Why transformers would build a different tokenizer from this folder than tokenizer.json
    alone (None: it would not). `added`: tokenizer.json's added tokens by id, each as its ADDED_TOKEN_FIELDS."""
    if config.get("tokenizer_class") not in PLAIN_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r}"
    if config.get("split_special_tokens"):
        return "split_special_tokens"
    if "fix_mistral_regex" in config:
        return "fix_mistral_regex"
    if (folder / CHAT_TEMPLATE_DIR).is_dir() or not isinstance(config.get("chat_template", ""), str):
        return "several chat templates"
    added_texts = {token["content"] for token in added.values()}
    # transformers adds any special token that is not an added token already
    named = [_token_text(config.get(attribute)) for attribute in SPECIAL_TOKEN_ATTRIBUTES]
    extra = [_token_text(token) for key in ("extra_special_tokens", "additional_special_tokens")
             for token in (config.get(key) or [])]
    if isinstance(config.get("extra_special_tokens"), dict):
        return "named extra special tokens"
    missing = [text for text in named + extra if text is not None and text not in added_texts]
    if missing:
        return f"special tokens {missing[:4]} are not added tokens of tokenizer.json"
    for key, token in (config.get("added_tokens_decoder") or {}).items():
        mine = added.get(int(key))
        if mine is None or any(mine.get(field) != token.get(field) for field in ADDED_TOKEN_FIELDS):
            return f"added token {key} differs from tokenizer.json's"
    return None


class PlainTokenizer:
    """tokenizer.json's Rust tokenizer, with tokenizer_config.json's special tokens and chat template."""

    def __init__(self, rust_tokenizer, config: dict, chat_template: str | None) -> None:
        self._tokenizer = rust_tokenizer
        self._tokenizer.no_truncation()  # as transformers' encode without truncation or padding
        self._tokenizer.no_padding()
        self._tokenizer.encode_special_tokens = False
        self.special_tokens_map = {attribute: _token_text(config[attribute]) for attribute in SPECIAL_TOKEN_ATTRIBUTES
                                   if _token_text(config.get(attribute)) is not None}
        self.chat_template = chat_template
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")

    def _id_of(self, attribute: str) -> int | None:
        text = self.special_tokens_map.get(attribute)
        return None if text is None else self._tokenizer.token_to_id(text)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, verbose: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("the plain tokenizer does not clean up spaces")
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None, tokenize: bool = False,
                            tools: list[dict] | None = None, add_generation_prompt: bool = False) -> str:
        if tokenize:
            raise ValueError("the plain tokenizer renders chat templates to text only")
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("the tokenizer has no chat template")
        return render_chat(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens_map)


def _with_special_tokens_map(config: dict, path: Path) -> dict:
    """tokenizer_config.json's entries with special_tokens_map.json's over them, as transformers
    merges that legacy file when the config has no added_tokens_decoder."""
    if not path.is_file():
        return config
    merged = dict(config)
    for key, value in json.loads(path.read_text(encoding="utf-8")).items():
        if key == "extra_special_tokens" and isinstance(value, list):
            existing = list(merged.get(key) or [])
            merged[key] = existing + [token for token in value if token not in existing]
        else:
            merged[key] = value
    return merged


def load_plain_tokenizer(folder: Path) -> tuple[PlainTokenizer | None, str | None]:
    """(the folder's tokenizer, None), or (None, why transformers must load it)."""
    config_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not config_path.is_file() or not tokenizer_path.is_file():
        return None, "no tokenizer.json and tokenizer_config.json"
    from tokenizers import Tokenizer as RustTokenizer

    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        rust_tokenizer = RustTokenizer.from_file(str(tokenizer_path))
        added = {int(token_id): {field: getattr(token, field) for field in ADDED_TOKEN_FIELDS}
                 for token_id, token in rust_tokenizer.get_added_tokens_decoder().items()}
        if not isinstance(config, dict):
            return None, "tokenizer_config.json is not an object"
        if "added_tokens_decoder" not in config:
            if (folder / "added_tokens.json").is_file():
                return None, "added_tokens.json"
            config = _with_special_tokens_map(config, folder / "special_tokens_map.json")
    except Exception as exc:  # tokenizers raises a plain Exception for a file it cannot parse
        return None, f"unreadable: {type(exc).__name__}: {exc}"
    refusal = plain_tokenizer_refusal(folder, config, added)
    if refusal is not None:
        return None, refusal
    template_file = folder / CHAT_TEMPLATE_FILE
    try:  # the separate file takes priority over tokenizer_config.json's entry, as in transformers
        chat_template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                         else config.get("chat_template"))
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"unreadable {CHAT_TEMPLATE_FILE}: {exc}"
    return PlainTokenizer(rust_tokenizer, config, chat_template or None), None
