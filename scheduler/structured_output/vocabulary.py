"""The model's vocabulary as llguidance sees it: the bytes of every token id, without torch.

llguidance's matchers need each token's bytes (and which ids are special, which is EOS) to turn
a grammar into a mask over the logits. The scheduler reads them from the checkpoint itself:

    HF folder     tokenizer.json (the `tokenizers` serialisation), given to llguidance whole
    GGUF file     tokenizer.ggml.tokens / token_type from the file's metadata:
                  gpt2 (byte-level BPE): each token is GPT-2's printable-byte encoding
                  llama (SentencePiece): U+2581 is a space, <0xNN> is one raw byte
                  control tokens get llguidance's 0xFF prefix (never produced by text)

The mask is as wide as the model's logits (`vocab_size`, possibly padded past the tokenizer);
ids without a token are never allowed.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import llguidance

from pagedserve.checkpoints.gguf_config import find_gguf_file, is_gguf, open_gguf

SPECIAL_PREFIX = b"\xff"  # llguidance's marker of a token no text encodes to
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


class VocabularyError(RuntimeError):
    """The checkpoint's tokenizer cannot be read for structured output."""


def load_vocabulary(model_path: str | Path, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """An llguidance tokenizer for the model at `model_path` (an HF folder or a GGUF model)."""
    eos = list(eos_token_ids) or None
    if is_gguf(model_path):
        gguf_file = find_gguf_file(model_path)
        tokens, special_ids = _gguf_tokens(str(gguf_file))
        return vocabulary_from_tokens(tokens, special_ids, eos_token_ids, vocab_size)
    tokenizer_json = Path(model_path) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise VocabularyError(f"{model_path} has no tokenizer.json")
    try:
        return llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos)
    except (ValueError, RuntimeError) as exc:
        raise VocabularyError(f"cannot read {tokenizer_json}: {exc}") from exc


def vocabulary_from_tokens(tokens: list[bytes], special_ids: list[int], eos_token_ids: list[int],
                           vocab_size: int) -> llguidance.LLTokenizer:
    """An llguidance tokenizer from each token's bytes (special tokens: SPECIAL_PREFIX + name)."""
    wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(tokens, special_ids, eos_token_ids[0] if eos_token_ids else 0))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


class _ByteTokenizer:
    """What llguidance.TokenizerWrapper reads: token bytes, special ids, and an encoder (greedy
    longest match; llguidance uses it to tokenize text the grammar forces, which it then checks
    token by token, so a tokenization that is valid but not the tokenizer's own is fine). It
    must not raise: a byte without a token of its own is left out."""

    def __init__(self, tokens: list[bytes], special_ids: list[int], eos_token_id: int) -> None:
        self.tokens = tokens
        self.special_token_ids = special_ids
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        self._ids = {token: index for index, token in enumerate(tokens) if token and index not in set(special_ids)}
        self._longest = max((len(token) for token in self._ids), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, str):
            text = text.encode()
        out, start = [], 0
        while start < len(text):
            for end in range(min(len(text), start + self._longest), start, -1):
                token_id = self._ids.get(text[start:end])
                if token_id is not None:
                    out.append(token_id)
                    start = end
                    break
            else:
                start += 1
        return out


@lru_cache(maxsize=4)
def _gguf_tokens(path: str) -> tuple[list[bytes], list[int]]:
    reader = open_gguf(path)
    fields = reader.fields
    if "tokenizer.ggml.tokens" not in fields:
        raise VocabularyError(f"{path} carries no tokenizer")
    model = fields["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in fields else "gpt2"
    texts = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in fields \
        else [1] * len(texts)
    byte_of = {char: byte for byte, char in _gpt2_byte_chars().items()}
    tokens, special_ids = [], []
    for token_id, (text, kind) in enumerate(zip(texts, types)):
        if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED) and text.startswith("<") and text.endswith(">"):
            tokens.append(SPECIAL_PREFIX + text.encode())
            special_ids.append(token_id)
        elif model == "gpt2":
            tokens.append(bytes(byte_of[char] for char in text) if all(char in byte_of for char in text)
                          else text.encode())
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            tokens.append(bytes([int(text[3:5], 16)]))
        else:
            tokens.append(text.replace("\u2581", " ").encode())
    return tokens, special_ids


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character standing for it in the vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}
