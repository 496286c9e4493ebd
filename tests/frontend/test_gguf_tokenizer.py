"""A GGUF model's tokenizer: converted by transformers from the file, cached, with its chat template."""

from __future__ import annotations

import pytest

from pagedserve.frontend.tokenization.gguf_tokenizer import tokenizer_cache_path
from pagedserve.frontend.tokenization.tokenizer import TokenizerLoadError, load_tokenizer
from pagedserve.testing.tiny_gguf import write_gguf
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.checkpoints.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
TEXTS = ["The old lighthouse stood at the edge of the harbour.", "naïve café, 3 € — ★", "  two  spaces\n\nand lines"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    build_tokenizer(folder, vocab_size=512)
    return build_tiny_checkpoint(folder, architecture="llama", vocab_size=512, hidden_size=64, num_layers=1,
                                 num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3,
                                 bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)


@pytest.fixture
def gguf_path(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    return write_gguf(checkpoint, tmp_path / "model" / "tiny.gguf", chat_template=TEMPLATE)


def test_encodes_like_the_original_tokenizer(gguf_path, checkpoint):
    ours, original = load_tokenizer(gguf_path.parent), load_tokenizer(checkpoint)
    for text in TEXTS:
        assert ours.encode(text) == original.encode(text)
        assert ours.encode(text)[0] == BOS_TOKEN_ID
        assert ours.decode(ours.encode(text)) == text
    assert ours.eos_token_ids == (EOS_TOKEN_ID,)
    assert ours.vocab_size == 513  # transformers' byte-level converter adds <|endoftext|> when a vocabulary lacks it


def test_chat_template_comes_from_the_file(gguf_path):
    tokenizer = load_tokenizer(gguf_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "[user] hi\n[assistant] "


def test_second_load_reads_the_cache(gguf_path, monkeypatch):
    first = load_tokenizer(gguf_path)
    assert (tokenizer_cache_path(gguf_path) / "tokenizer.json").is_file()
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained.__func__

    def no_conversion(cls, *args, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError("converted from the GGUF again")
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(no_conversion))
    second = load_tokenizer(gguf_path)
    for text in TEXTS:
        assert second.encode(text) == first.encode(text)
    assert second.chat_template == TEMPLATE
    assert second.info == first.info


def test_unusable_cache_is_rebuilt_or_skipped(gguf_path, tmp_path, monkeypatch):
    cached = tokenizer_cache_path(gguf_path)
    cached.mkdir(parents=True)
    (cached / "tokenizer_config.json").write_text("{not json")
    assert load_tokenizer(gguf_path).encode("harbour") == load_tokenizer(gguf_path).encode("harbour")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(blocker))
    assert load_tokenizer(gguf_path).encode("harbour")[0] == BOS_TOKEN_ID


def test_broken_gguf_is_a_load_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 20)
    with pytest.raises(TokenizerLoadError, match="broken.gguf"):
        load_tokenizer(path)
