"""Quantized matmuls against their dequantize-then-matmul references, and the int4 packing."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.kernels.linear.int4_layout import Int4Layout, check_round_trip, pack_int4, unpack_int4, unpack_int4_columns
from pagedserve.kernels.linear.packed_weights import Int4Weight, Int8Weight
from pagedserve.kernels.linear.quantized import (
    MAX_KERNEL_ROWS,
    int4_linear_dequant,
    int4_linear_packed_mm,
    int8_linear_dequant,
    int8_linear_packed_mm,
    quantized_linear_by_rows,
)
from pagedserve.kernels.linear.quantized_reference import int4_linear_ref, int8_linear_ref
from pagedserve.worker.quantization.quantizers import quantize_int4, quantize_int8

TOLERANCE = 1e-2  # relative Frobenius error; bfloat16 activations give a few 1e-3


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _weight(num_rows: int, num_cols: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_cols, generator=generator) / num_cols ** 0.5


def _inputs(num_tokens: int, num_cols: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_cols, generator=generator).to(dtype)


@pytest.mark.parametrize("num_rows", [16, 48, 64, 80, 192, 960])
@pytest.mark.parametrize("num_cols", [2, 64, 576])
def test_unpack_inverts_torch_packing(num_rows, num_cols):
    generator = torch.Generator().manual_seed(num_rows + num_cols)
    codes = torch.randint(0, 16, (num_rows, num_cols), generator=generator, dtype=torch.int32)
    packed = pack_int4(codes)
    assert torch.equal(unpack_int4(packed, num_rows, num_cols), codes.to(torch.uint8))
    columns = unpack_int4_columns(packed, num_rows, num_cols)  # [K, N] in the layout's row order
    assert torch.equal(columns, codes.to(torch.uint8).t()[:, Int4Layout.probe(num_rows).column_rows])
    assert check_round_trip(num_rows, num_cols)


def test_probe_finds_whole_row_blocks():
    layout = Int4Layout.probe(80)  # 64 + a 16-row tail on AVX-512, 32 + 32 + 16 elsewhere
    assert sum(block.num_rows for block in layout.blocks) == 80
    assert sorted(layout.column_rows.tolist()) == list(range(80))


@pytest.mark.parametrize("num_tokens", [1, 5, MAX_KERNEL_ROWS["int8"] + 1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_int8_paths_match_reference(num_tokens, dtype, has_bias):
    weight = quantize_int8(_weight(96, 160, seed=2))
    x = _inputs(num_tokens, 160, dtype)
    bias = torch.randn(96).to(dtype) if has_bias else None
    expected = int8_linear_ref(x, weight, bias)
    assert expected.dtype == dtype and expected.shape == (num_tokens, 96)
    for path in (int8_linear_packed_mm, int8_linear_dequant, quantized_linear_by_rows, ops.quantized_linear):
        actual = path(x, weight, bias)
        assert actual.dtype == dtype and actual.shape == expected.shape
        assert _relative_error(actual, expected) < TOLERANCE, path.__name__


@pytest.mark.parametrize("num_tokens", [1, 3, 17, MAX_KERNEL_ROWS["int4"] + 1])
@pytest.mark.parametrize("group_size,num_cols", [(32, 96), (64, 576), (128, 576), (128, 1536), (256, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [80, 192])  # 80: a tail block, out of row order; 192: whole blocks
def test_int4_paths_match_reference(num_tokens, group_size, num_cols, dtype, num_rows):
    weight = quantize_int4(_weight(num_rows, num_cols, seed=3), group_size)
    x = _inputs(num_tokens, num_cols, dtype)
    bias = torch.randn(num_rows).to(dtype)
    expected = int4_linear_ref(x, weight, bias)
    for path in (int4_linear_packed_mm, int4_linear_dequant, quantized_linear_by_rows, ops.quantized_linear):
        actual = path(x, weight, bias)
        assert actual.dtype == dtype and actual.shape == (num_tokens, num_rows)
        assert _relative_error(actual, expected) < TOLERANCE, path.__name__


def test_reference_is_dequantize_then_matmul():
    dense = _weight(32, 128, seed=4)
    x = _inputs(3, 128, torch.float32)
    for weight in (quantize_int8(dense), quantize_int4(dense, 32)):
        assert torch.allclose((int8_linear_ref if isinstance(weight, Int8Weight) else int4_linear_ref)(x, weight),
                              x @ weight.dequantize().t(), atol=1e-5)


def test_quantization_error_is_small():
    dense = _weight(64, 576, seed=5)
    assert _relative_error(quantize_int8(dense).dequantize(), dense) < 0.01
    assert _relative_error(quantize_int4(dense, 32).dequantize(), dense) < 0.12
    int4_128 = quantize_int4(dense, 128)  # 576 = 4.5 groups: the last one short, padded
    assert int4_128.padded_in_features == 640 and int4_128.dequantize().shape == (64, 576)
    assert _relative_error(int4_128.dequantize(), dense) < 0.15


def test_weights_validate_their_shapes():
    with pytest.raises(ValueError, match="group size"):
        Int4Weight(packed=torch.zeros(16, 32, dtype=torch.uint8), scales_and_zeros=torch.zeros(1, 16, 2),
                   group_size=48, in_features=64)
    with pytest.raises(ValueError, match="scales"):
        Int8Weight(qweight=torch.zeros(4, 8, dtype=torch.int8), scales=torch.zeros(3))
