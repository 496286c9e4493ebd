"""Plain-torch quantized linear layers: dequantize the weight, then one float32 matmul.

The reference (the oracle in tests) for every quantized matmul in
linear/quantized.py; same signature: x [M, K] in any float dtype -> [M, N] in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.linear.packed_weights import Int4Weight, Int8Weight


def int8_linear_ref(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> x @ dequantize(weight).T + bias, [M, N]."""
    y = F.linear(x.to(torch.float32), weight.dequantize(torch.float32))  # [M, N]
    return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)


def int4_linear_ref(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> x @ dequantize(weight).T + bias, [M, N]."""
    y = F.linear(x.to(torch.float32), weight.dequantize(torch.float32))  # [M, N]
    return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)
