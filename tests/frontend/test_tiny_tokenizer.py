"""The tiny tokenizer builder and the frontend's tokenizer wrapper."""

from __future__ import annotations

import json

import pytest

from pagedserve.frontend.tokenization.tokenizer import TokenizerLoadError, load_tokenizer
from pagedserve.checkpoints.tiny_tokenizer import (
    BOS_TOKEN_ID, EOS_TOKEN_ID, MIN_VOCAB_SIZE, PAD_TOKEN_ID, UNK_TOKEN_ID, build_tokenizer,
)

TEXT = "The keeper climbed the stairs: café, 3 €, Zürich ★ and 1024 tokens."


def test_build_is_deterministic_and_loads_with_auto_tokenizer(tmp_path, tokenizer_folder):
    from transformers import AutoTokenizer

    again = build_tokenizer(tmp_path / "again", vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / name).read_bytes() == (tokenizer_folder / name).read_bytes(), name
    hf = AutoTokenizer.from_pretrained(again)
    assert len(hf) == 512
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (
        UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID)
    ids = hf.encode(TEXT)
    assert ids[0] == BOS_TOKEN_ID and BOS_TOKEN_ID not in ids[1:]
    assert max(ids) < 512
    assert hf.decode(ids, skip_special_tokens=True) == TEXT
    assert len(ids) < len(TEXT.encode()), "no merges were learnt"


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, 2048])
def test_vocabulary_has_exactly_the_requested_size(tmp_path, vocab_size):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path, vocab_size=vocab_size))
    assert len(hf) == vocab_size
    assert hf.decode(hf.encode(TEXT), skip_special_tokens=True) == TEXT


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE - 1, 0, 10**6])
def test_vocabulary_size_out_of_range_is_refused(tmp_path, vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=vocab_size)


def test_frontend_tokenizer_encodes_with_bos_and_decodes_without_specials(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert ids[0] == BOS_TOKEN_ID
    assert tokenizer.decode(ids + [EOS_TOKEN_ID, PAD_TOKEN_ID]) == TEXT
    assert tokenizer.decode([tokenizer.vocab_size + 5]) == ""
    assert tokenizer.vocab_size == 512
    assert tokenizer.eos_token_ids == (EOS_TOKEN_ID,)
    assert tokenizer.info.bos_token_id == BOS_TOKEN_ID


def test_eos_ids_also_come_from_the_checkpoint_config(tmp_path, tokenizer_folder):
    folder = build_tokenizer(tmp_path, vocab_size=512)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
              "num_attention_heads": 4, "num_hidden_layers": 2, "eos_token_id": [EOS_TOKEN_ID, 7]}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert load_tokenizer(folder).eos_token_ids == (EOS_TOKEN_ID, 7, 9)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(tmp_path)
