"""Quantized linear layers for production: PyTorch's packed CPU kernels for few rows, a bfloat16
dequantize-then-matmul for many.

Same signature and result (within bfloat16 rounding) as the references (linear/quantized_reference.py):
x [M, K] in any float dtype -> [M, N] in x's dtype. All compute runs on bfloat16 activations:
the packed kernels are much slower on float32 ones (bench/quant_matmul.py; docs/quantization.md).

    int8_linear_packed_mm   torch._weight_int8pack_mm: int8 weight, one scale per row
    int4_linear_packed_mm   torch._weight_int4pack_mm_for_cpu: tinygemm layout, groups along K
    int8_linear_dequant     (x @ int8 weight as bfloat16) * scales: one conversion pass over the weight
    int4_linear_dequant     the weight unpacked in its packed row order (no gather), dequantized in
                            bfloat16, one dense matmul, the output columns put back in row order
                            (a no-op for the AVX-512 and AVX2 layouts of whole 64/32-row blocks)

The packed kernels stream the weight once per call but compute every row's products with
scalar broadcasts: they win at decode batch sizes, where a dense matmul is bound by reading
weights, and lose badly on prefill chunks, where the dense bfloat16 matmul (AMX/AVX-512) is far
ahead and dequantizing the weight once per call costs less than it saves. `quantized_linear_by_rows` picks by
rows: the packed kernel up to MAX_KERNEL_ROWS[format], the dequantizing path above. The bounds are
the crossovers bench/quant_matmul.py finds on SmolLM2-135M's layer shapes (docs/quantization.md):
int8 dequantizing costs one conversion pass and wins from about 16 rows; int4 unpacking and
dequantizing costs about four passes and wins only from about 64 rows.
Nothing is cached: weights stay quantized (a bfloat16 copy beside the codes would make every row
count as fast as dense bfloat16, at 2 bytes per weight more).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.linear.int4_layout import Int4Layout, unpack_int4_columns
from pagedserve.kernels.linear.packed_weights import SCALE_DTYPE, Int4Weight, Int8Weight, PackedWeight

COMPUTE_DTYPE = SCALE_DTYPE  # bfloat16
MAX_KERNEL_ROWS = {"int8": 16, "int4": 64}


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    y = y.to(dtype)
    return y if bias is None else y + bias.to(dtype)


def _padded(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:  # [M, K] -> [M, K_padded] bfloat16
    x = x.to(COMPUTE_DTYPE)
    extra = weight.padded_in_features - x.shape[1]
    return F.pad(x, (0, extra)) if extra else x.contiguous()


def int8_linear_packed_mm(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch._weight_int8pack_mm(x.to(COMPUTE_DTYPE).contiguous(), weight.qweight, weight.scales)  # [M, N]
    return _finish(y, bias, x.dtype)


def int4_linear_packed_mm(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch._weight_int4pack_mm_for_cpu(_padded(x, weight), weight.packed, weight.group_size,
                                          weight.scales_and_zeros)  # [M, N]
    return _finish(y, bias, x.dtype)


def int8_linear_dequant(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row scales commute with the matmul: (x @ q^T) * s, so the weight is only converted."""
    y = F.linear(x.to(COMPUTE_DTYPE), weight.qweight.to(COMPUTE_DTYPE))  # [M, N] bfloat16
    return _finish(y.to(torch.float32) * weight.scales.to(torch.float32), bias, x.dtype)


def int4_linear_dequant(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    num_rows, padded = weight.out_features, weight.padded_in_features
    layout = Int4Layout.probe(num_rows)
    device = weight.packed.device
    codes = unpack_int4_columns(weight.packed, num_rows, padded)  # [K_padded, N] in layout order
    scales_and_zeros = weight.scales_and_zeros.to(torch.float32)  # [groups, N, 2]
    if not layout.is_row_order:
        scales_and_zeros = scales_and_zeros.index_select(1, layout.column_rows.to(device))
    scale = scales_and_zeros[..., 0]  # [groups, N], layout order
    offset = scales_and_zeros[..., 1] - 8.0 * scale  # (code - 8) * scale + zero = code * scale + offset
    dense = torch.addcmul(offset[:, None, :].to(COMPUTE_DTYPE),
                          codes.view(-1, weight.group_size, num_rows).to(COMPUTE_DTYPE),
                          scale[:, None, :].to(COMPUTE_DTYPE))  # [groups, G, N]
    y = torch.mm(_padded(x, weight), dense.view(padded, num_rows))  # [M, N], layout order
    if not layout.is_row_order:
        y = y.index_select(1, layout.row_positions.to(device))
    return _finish(y, bias, x.dtype)


def quantized_linear_by_rows(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N]: the packed kernel for M <= MAX_KERNEL_ROWS[format], else dequantize-then-matmul."""
    if isinstance(weight, Int8Weight):
        is_few_rows = x.shape[0] <= MAX_KERNEL_ROWS["int8"]
        return (int8_linear_packed_mm if is_few_rows else int8_linear_dequant)(x, weight, bias)
    is_few_rows = x.shape[0] <= MAX_KERNEL_ROWS["int4"]
    return (int4_linear_packed_mm if is_few_rows else int4_linear_dequant)(x, weight, bias)
