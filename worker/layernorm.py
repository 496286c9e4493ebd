"""RMSNorm as Llama-family checkpoints define it, with the residual add folded in.

    y = weight * (x / sqrt(mean(x^2) + eps))   statistics in float32

One call of torch's rms_norm (a fused composite: its ops are dispatched from C++, not Python). In
float32 it equals Hugging Face's LlamaRMSNorm bit for bit; in bfloat16 it multiplies by the weight
in float32 and rounds once, where Hugging Face rounds the normalised x to bfloat16 first and then
again after the weight, so results differ by at most a unit in the last place.

The residual form adds x into the residual stream in place and returns both the normalised sum
and the sum, so a decoder layer carries one residual tensor through all layers:
(norm(x + residual), x + residual), the second being `residual` itself, updated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.worker.parallel_layers import TensorSlice, whole_tensor


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
        if residual is None:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        residual.add_(x)  # [T, hidden]
        return F.rms_norm(residual, (self.hidden_size,), self.weight, self.eps), residual

    def checkpoint_slices(self, param_prefix: str, checkpoint_prefix: str) -> list[TensorSlice]:
        return [whole_tensor(f"{checkpoint_prefix}.weight", (self.hidden_size,), f"{param_prefix}.weight")]
