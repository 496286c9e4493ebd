"""RMSNorm as Llama-family checkpoints define it, with the residual add folded in.

    y = weight * (x / sqrt(mean(x^2) + eps))   statistics in float32, scaled in the model dtype

Two calls: torch's rms_norm without a weight (a composite whose ops are dispatched from C++, not
Python; it normalises in float32 and rounds to the model dtype), then the weight in place. That
is Hugging Face's LlamaRMSNorm bit for bit in every dtype, the bfloat16 roundings included (the
normalised x rounded first, then the product). Passing the weight to rms_norm would save the
second call but multiply in float32 and round once: in bfloat16 a unit in the last place apart,
which was enough for SmolLM2 to answer the quick-start question wrongly.

In bfloat16 on the CPU, both calls and the residual add run as one native kernel
(kernels/native/rms_norm.c; pagedserve.kernels.ops.add_rms_norm picks it) with the same two
roundings. Its float32 sum of squares is not summed in torch's order, so the normalising factor
can differ in its last bit, which changes a bfloat16 result in rare cases (docs/kernels.md counts
them); float32 keeps torch's calls and stays exact.

The residual form adds x into the residual stream in place and returns both the normalised sum
and the sum, so a decoder layer carries one residual tensor through all layers:
(norm(x + residual), x + residual), the second being `residual` itself, updated.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import ops
from pagedserve.worker.layers.parallel import TensorSlice, whole_tensor


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        if eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, not {eps}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> norm(x); with residual [T, hidden] -> (norm(x + residual), residual += x)."""
        normed = ops.add_rms_norm(x, residual, self.weight, self.eps)  # [T, hidden]
        return normed if residual is None else (normed, residual)

    def checkpoint_slices(self, param_prefix: str, checkpoint_prefix: str) -> list[TensorSlice]:
        return [whole_tensor(f"{checkpoint_prefix}.weight", (self.hidden_size,), f"{param_prefix}.weight")]
