"""RMSNorm as Llama-family checkpoints define it, with the residual add folded in.

    y = weight * (x / sqrt(mean(x^2) + eps))   statistics in float32, scaled in the model dtype

The residual form returns both the normalised sum and the sum itself, so a decoder layer carries
one residual stream without extra copies:  (norm(x + residual), x + residual).
"""

from __future__ import annotations

import torch

from pagedserve.worker.parallel_layers import TensorSlice, whole_tensor


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        if eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, not {eps}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        x32 = x.float()  # [T, hidden]
        variance = x32.pow(2).mean(-1, keepdim=True)  # [T, 1]
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> norm(x); with residual [T, hidden] -> (norm(x + residual), x + residual)."""
        if residual is None:
            return self._normalize(x)
        summed = x + residual  # [T, hidden]
        return self._normalize(summed), summed

    def checkpoint_slices(self, param_prefix: str, checkpoint_prefix: str) -> list[TensorSlice]:
        return [whole_tensor(f"{checkpoint_prefix}.weight", (self.hidden_size,), f"{param_prefix}.weight")]
