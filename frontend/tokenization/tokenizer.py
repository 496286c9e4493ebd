"""The checkpoint folder's tokenizer (the frontend's only model file).

Where transformers would use tokenizer.json's Rust tokenizer unchanged, it is read with the
`tokenizers` library alone (plain_tokenizer.py), so the frontend starts without importing
transformers and torch; any other folder is loaded with transformers.AutoTokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedserve.checkpoints.gguf_config import GGUFError, is_gguf, read_gguf_config
from pagedserve.checkpoints.model_config import ModelConfigError, load_model_info
from pagedserve.frontend.tokenization.plain_tokenizer import PlainTokenizer, load_plain_tokenizer
from pagedserve.log import get_logger

log = get_logger(component="tokenizer")


class TokenizerLoadError(RuntimeError):
    """The folder holds no tokenizer that transformers can load."""


PLAIN, TRANSFORMERS = "tokenizers", "transformers"  # Tokenizer.backend


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    vocab_size: int  # every id the tokenizer knows, added tokens included
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


class Tokenizer:
    """Encodes prompts and decodes completions with one Hugging Face tokenizer: a transformers
    tokenizer, or the PlainTokenizer that gives its results (`backend`).

    Encoding adds special tokens (BOS) exactly as the tokenizer's own config asks; decoding skips
    special tokens and never rewrites spaces, so decoding a concatenation equals concatenating the
    incremental pieces (see detokenizer.py).
    """

    def __init__(self, hf_tokenizer, extra_eos_token_ids: Sequence[int] = ()) -> None:
        self._hf = hf_tokenizer
        self.backend = PLAIN if isinstance(hf_tokenizer, PlainTokenizer) else TRANSFORMERS
        eos_ids: list[int] = []
        if hf_tokenizer.eos_token_id is not None:
            eos_ids.append(int(hf_tokenizer.eos_token_id))
        for token_id in extra_eos_token_ids:
            if token_id not in eos_ids:
                eos_ids.append(int(token_id))
        self.info = TokenizerInfo(
            vocab_size=len(hf_tokenizer),
            bos_token_id=None if hf_tokenizer.bos_token_id is None else int(hf_tokenizer.bos_token_id),
            eos_token_ids=tuple(eos_ids),
        )

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info.eos_token_ids

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's own chat template (tokenizer_config.json, or a GGUF file's metadata), or None."""
        template = getattr(self._hf, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS (and EOS) added when the tokenizer's config says so, unless
        `add_special_tokens` is False (a rendered chat template holds its special tokens already)."""
        # verbose=False: over-long prompts are refused by validation, not warned about on stderr.
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def render_chat(self, messages: list[dict], template: str, add_generation_prompt: bool,
                    tools: list[dict] | None = None) -> str:
        """The chat `messages` rendered by the Jinja `template` as transformers renders it (the
        same variables: bos_token, eos_token, raise_exception, tools …); template errors propagate."""
        return self._hf.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tools,
                                            add_generation_prompt=add_generation_prompt)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone, special tokens included (for logprobs); a token that is
        part of a multi-byte character decodes to U+FFFD."""
        return self._hf.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for chat `messages` ({"role", "content"} dicts) under the model's template."""
        if not self.chat_template:
            raise TokenizerLoadError("the model has no chat template")
        return self._hf.apply_chat_template(list(messages), tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens skipped; ids the tokenizer does not know decode to ''."""
        return self._hf.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def load_tokenizer(model_path: str | Path) -> Tokenizer:
    """Loads the tokenizer of a checkpoint folder; EOS ids also come from config.json and
    generation_config.json when the folder is a supported checkpoint. A GGUF model (a .gguf file or
    a folder holding one) carries its tokenizer, EOS ids and chat template in its metadata."""
    if is_gguf(model_path):
        return _load_gguf_tokenizer(model_path)
    folder = Path(model_path)
    if not folder.is_dir():
        raise TokenizerLoadError(f"{folder} is not a folder")
    hf_tokenizer, why_not_plain = load_plain_tokenizer(folder)
    if hf_tokenizer is None:
        from transformers import AutoTokenizer

        log.info("tokenizer_through_transformers", path=str(folder), reason=why_not_plain)
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TokenizerLoadError(f"cannot load a tokenizer from {folder}: {exc}") from exc
    extra_eos: list[int] = []
    if (folder / "config.json").is_file():
        try:
            extra_eos = load_model_info(folder).eos_token_ids
        except (ModelConfigError, KeyError, ValueError):
            extra_eos = []
    return Tokenizer(hf_tokenizer, extra_eos_token_ids=extra_eos)


def _load_gguf_tokenizer(model_path: str | Path) -> Tokenizer:
    from pagedserve.frontend.tokenization.gguf_tokenizer import load_gguf_tokenizer

    try:
        eos_ids = read_gguf_config(model_path).eos_token_ids  # first: refuses a broken file clearly
        hf_tokenizer = load_gguf_tokenizer(model_path)
    except (GGUFError, OSError, ValueError, KeyError) as exc:
        raise TokenizerLoadError(f"cannot load a tokenizer from {model_path}: {exc}") from exc
    return Tokenizer(hf_tokenizer, extra_eos_token_ids=eos_ids)
