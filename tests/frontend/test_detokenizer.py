"""Incremental detokenization: no broken characters, equal to a full decode at the end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.frontend.tokenization.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from pagedserve.checkpoints.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID

MULTIBYTE_TEXT = "Prices: 3 € in Zürich, a star ★, a heart ♥ and “quotes” — done."


def _pieces(tokenizer, token_ids, chunk_sizes=None):
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = []
    position = 0
    sizes = iter(chunk_sizes or [])
    while position < len(token_ids):
        size = max(1, next(sizes, 1))
        pieces.append(detokenizer.add(token_ids[position:position + size]))
        position += size
    pieces.append(detokenizer.finish())
    return pieces


def test_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode(" €")[1:]
    assert len(ids) == 3, "the euro sign should be split into three byte tokens by this tokenizer"
    assert [tokenizer.decode([i]) for i in ids] == [" " + REPLACEMENT_CHAR, REPLACEMENT_CHAR, REPLACEMENT_CHAR]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(ids[:1]) == ""
    assert detokenizer.add(ids[1:2]) == ""
    assert detokenizer.add(ids[2:]) == " €"
    assert detokenizer.finish() == ""


def test_pieces_of_real_text_never_contain_replacement_chars(tokenizer):
    ids = tokenizer.encode(MULTIBYTE_TEXT)[1:]
    pieces = _pieces(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert "".join(pieces) == MULTIBYTE_TEXT
    assert sum(1 for piece in pieces if piece) > 10, "text should stream in many pieces"


def test_special_tokens_are_skipped_even_inside_a_split_character(tokenizer):
    euro = tokenizer.encode(" €")[1:]
    ids = [BOS_TOKEN_ID, *tokenizer.encode("ab")[1:], euro[0], EOS_TOKEN_ID, *euro[1:], EOS_TOKEN_ID]
    pieces = _pieces(tokenizer, ids)
    assert "".join(pieces) == "ab €" == tokenizer.decode(ids)


def test_unfinished_character_at_the_end_is_released_by_finish(tokenizer):
    euro = tokenizer.encode(" €")[1:]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(tokenizer.encode("ok")[1:]) == "ok"
    assert detokenizer.add(euro[:2]) == ""
    tail = detokenizer.finish()
    assert tail == tokenizer.decode(euro[:2])
    assert tail.endswith(REPLACEMENT_CHAR)
    assert detokenizer.finish() == ""


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_ids_concatenate_to_the_full_decode(tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size + 3), max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=40), label="chunk sizes")
    full = tokenizer.decode(ids)
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = ""
    position = 0
    size_iter = iter(sizes)
    while position < len(ids):
        size = next(size_iter, 1)
        emitted += detokenizer.add(ids[position:position + size])
        position += size
        assert full.startswith(emitted), "an emitted piece disagrees with the full decode"
    emitted += detokenizer.finish()
    assert emitted == full


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab €★♥éü\n'")), max_size=30),
       sizes=st.lists(st.integers(1, 3), max_size=30))
def test_valid_text_streams_without_replacement_chars(tokenizer, text, sizes):
    ids = tokenizer.encode(text)[1:]
    pieces = _pieces(tokenizer, ids, sizes)
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)
    assert "".join(pieces) == text
