"""A vocabulary for structured-output tests of the scheduler: the digest worker's 24 ids, id 0
EOS, every other id one character, so a token sequence reads as text."""

from __future__ import annotations

from scheduler_harness import EOS_TOKEN_ID, VOCAB_SIZE

from pagedserve.scheduler.structured_output.compiler import GrammarCompiler
from pagedserve.scheduler.structured_output.vocabulary import SPECIAL_PREFIX, vocabulary_from_tokens

CHARACTERS = '{}":,[] 0123456789abcxy'
TOKENS = [SPECIAL_PREFIX + b"<eos>"] + [char.encode() for char in CHARACTERS]
assert len(TOKENS) == VOCAB_SIZE and EOS_TOKEN_ID == 0


def token_ids(text: str) -> list[int]:
    return [TOKENS.index(char.encode()) for char in text]


def text_of(ids: list[int]) -> str:
    return "".join(TOKENS[token].decode() for token in ids if token != EOS_TOKEN_ID)


def compiler() -> GrammarCompiler:
    return GrammarCompiler(lambda: vocabulary_from_tokens(TOKENS, [EOS_TOKEN_ID], [EOS_TOKEN_ID], VOCAB_SIZE))
