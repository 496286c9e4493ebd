"""The quick GGUF header reader gives what gguf.GGUFReader gives: every metadata field's contents
and every tensor (name, type, shape, sizes, offset, the same bytes), on the tiny model's file and
the real model's; and a truncated file is still refused clearly."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from pagedserve.checkpoints.gguf_config import GGUFFormatError, open_gguf
from pagedserve.checkpoints.gguf_header import GGUFHeader
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.checkpoints.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tokenizer
from pagedserve.testing.tiny_gguf import write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    build_tokenizer(folder, vocab_size=512)
    build_tiny_checkpoint(folder, architecture="llama", vocab_size=512, hidden_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, intermediate_size=64, seed=3, bos_token_id=BOS_TOKEN_ID,
                          eos_token_id=EOS_TOKEN_ID)
    return write_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf", chat_template="{{ messages }}")


def _assert_same(path) -> None:
    ours, theirs = GGUFHeader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == [int(kind) for kind in field.types], name
        assert ours.fields[name].contents() == field.contents(), name
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, other in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == (
            other.name, other.tensor_type, other.n_elements, other.n_bytes, other.data_offset)
        assert np.array_equal(mine.shape, other.shape) and mine.shape.dtype == other.shape.dtype
        assert mine.data.dtype == other.data.dtype and mine.data.shape == other.data.shape, mine.name
        assert np.array_equal(mine.data.view(np.uint8), other.data.view(np.uint8)), mine.name


def test_the_tiny_models_file_reads_as_gguf_reader_reads_it(tiny_gguf):
    _assert_same(tiny_gguf)


def test_the_real_models_file_reads_as_gguf_reader_reads_it():
    from pagedserve.checkpoints.smollm2 import ensure_smollm2

    _assert_same(ensure_smollm2())


def test_open_gguf_uses_the_quick_reader_and_refuses_a_truncated_file(tiny_gguf, tmp_path):
    assert isinstance(open_gguf(tiny_gguf), GGUFHeader)
    data = tiny_gguf.read_bytes()
    for size in (30, len(data) // 3, len(data) - 100):
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFFormatError, match="truncated or corrupt|is truncated"):
            open_gguf(cut)
