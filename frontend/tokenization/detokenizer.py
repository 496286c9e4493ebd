"""Incremental detokenization of one completion, never emitting a broken UTF-8 character.

Byte-level BPE splits a multi-byte character across tokens ("€" = E2 82 AC may arrive as the
tokens [E2 82] and [AC]), and SentencePiece decoders drop the leading space of the first token
they see. Both are handled by decoding a short window of ids twice:

```
 ids:  t0 t1 t2 t3 | t4 t5 | t6 t7 (new)
                   ^prefix ^read
 prefix_text = decode(ids[prefix:read])   text already emitted, kept as context
 new_text    = decode(ids[prefix:])       the same context plus the new ids
 emit new_text[len(prefix_text):]         unless it ends in U+FFFD (an unfinished character):
                                          then hold everything back until more ids arrive
```

After an emission the window slides: prefix = read, read = len(ids). `finish()` emits what is
still held back (an unfinished character at the very end decodes to U+FFFD, as a full decode
would), so the concatenation of every piece equals `tokenizer.decode(all ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns the token ids of one completion, arriving in pieces, into text pieces."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Appends ids; returns the text they complete ('' while a character is unfinished)."""
        if not new_token_ids:
            return ""
        self._token_ids.extend(new_token_ids)
        new_text = self._decoder.decode(self._token_ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        piece = new_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decoder.decode(self._token_ids[self._prefix_offset:self._read_offset])
        return piece

    def finish(self) -> str:
        """Returns whatever is still held back; call once, when the completion has finished."""
        if self._read_offset == len(self._token_ids):
            return ""
        full_text = self._decoder.decode(self._token_ids[self._prefix_offset:])
        piece = full_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self._prefix_text = ""
        return piece
