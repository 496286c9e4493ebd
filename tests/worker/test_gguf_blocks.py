"""GGUF blocks: int4/int8 group forms and column cuts decode exactly as gguf.quants.dequantize does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedserve.worker.quantization.gguf_blocks import GGUFBlocks, GGUFBlocksError, to_int4_groups, to_int8_groups

ROWS, COLS = 6, 128


def _blocks(kind: str, seed: int = 0) -> tuple[GGUFBlocks, np.ndarray]:
    """Random weights quantized to `kind`, and gguf's own decoding of them."""
    weights = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)
    weights[1, :32] = 0.0  # an all-zero group (scale 0)
    weights[2, 32:64] = 3.5  # a constant group (Q4_1: zero range)
    data = quantize(weights, GGMLQuantizationType[kind])
    return GGUFBlocks(kind, (ROWS, COLS), data), dequantize(data, GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_groups_equal_gguf_dequantize(kind):
    blocks, reference = _blocks(kind)
    groups = to_int4_groups(blocks)
    assert groups.values.dtype == torch.uint8 and groups.values.shape == (ROWS, COLS)
    assert int(groups.values.max()) <= 15
    assert groups.scales.shape == groups.mins.shape == (ROWS, COLS // 32)
    assert groups.scales.dtype == groups.mins.dtype == torch.float32
    assert torch.equal(groups.dequantize(), torch.from_numpy(reference))
    if kind == "Q4_0":
        assert torch.equal(groups.mins, -8 * groups.scales)


def test_int4_values_follow_the_nibble_layout():
    """Byte j of a block holds value j (low nibble) and value j + 16 (high nibble)."""
    blocks, _ = _blocks("Q4_0")
    groups = to_int4_groups(blocks)
    first_block = np.asarray(blocks.data[0, 2:18])  # after the f16 scale
    assert groups.values[0, :16].tolist() == (first_block & 0x0F).tolist()
    assert groups.values[0, 16:32].tolist() == (first_block >> 4).tolist()


def test_int8_groups_equal_gguf_dequantize():
    blocks, reference = _blocks("Q8_0")
    groups = to_int8_groups(blocks)
    assert groups.values.dtype == torch.int8 and groups.values.shape == (ROWS, COLS)
    assert groups.scales.shape == (ROWS, COLS // 32)
    assert torch.equal(groups.dequantize(), torch.from_numpy(reference))


def test_wrong_block_type_is_refused():
    blocks, _ = _blocks("Q8_0")
    with pytest.raises(GGUFBlocksError, match="Q8_0"):
        to_int4_groups(blocks)
    with pytest.raises(GGUFBlocksError, match="Q4_1"):
        to_int8_groups(_blocks("Q4_1")[0])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32"])
def test_rows_and_columns_cut_like_the_decoded_tensor(kind):
    blocks, reference = _blocks(kind, seed=1)
    assert np.array_equal(blocks.dequantize(), reference)
    assert np.array_equal(blocks.rows(2, 3).dequantize(), reference[2:5])
    assert np.array_equal(blocks.take_rows(np.array([4, 0, 3])).dequantize(), reference[[4, 0, 3]])
    aligned = blocks.columns(64, 32)  # whole blocks: still undecoded
    assert aligned.tensor_type == kind and aligned.shape == (ROWS, 32)
    assert np.array_equal(aligned.dequantize(), reference[:, 64:96])
    unaligned = blocks.columns(48, 40)
    assert np.array_equal(unaligned.dequantize(), reference[:, 48:88])
    if kind not in ("F32", "F16", "BF16"):
        assert unaligned.tensor_type == "F32"  # cut inside blocks: decoded first
