"""bfloat16 linear layers on the CPU with their weights reordered once, at load, into oneDNN's
blocked layout; the reference is `F.linear` on the dense weight (torch.equal in tests).

`F.linear` on a bfloat16 CPU tensor hands a plain [out, in] weight to oneDNN, which reorders it
into its blocked layout on every call: with few rows (decoding) that reorder costs as much as the
product (docs/kernels.md has the timings).

The prepacked weight carries no batch-size hint, so one reorder serves every row count with the
same blocking, and the results equal F.linear's bit for bit. It is an opaque oneDNN tensor beside
the dense weight, which the model keeps (embeddings, tensor-parallel slices, checks read it):
the layers' bfloat16 weights are held twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_prepack(weight: torch.Tensor) -> bool:
    """A bfloat16 CPU weight [out, in], with oneDNN built in and bfloat16 supported by this CPU."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same values in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def prepacked_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in], packed (prepack_linear_weight of weight [out, in]) -> x @ weight^T + bias [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepacked_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)
