"""Torch references of the fused per-layer CPU kernels (kernels/native/*.c via layer/native.py):
the oracle in tests and the path for whatever the native kernels do not take (CUDA, fp8 caches,
float16, PAGEDSERVE_KERNELS=reference, no C compiler).

    add_rms_norm(x, residual, weight, eps)   residual += x; norm(residual) * weight  (or norm(x) * weight)
    silu_mul(gate_up, inner)                 silu(gate) * up of a fused gate/up projection
    rotary_write_kv(...)                     RoPE on the query and key heads of a fused QKV projection
                                             in place, then the new K/V written into the paged cache

Each rounds as the separate torch ops round in the model's dtype (see pagedserve.worker.layers.layernorm
and pagedserve.worker.layers.rotary for why those roundings matter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x [T, H], residual [T, H] or None (updated in place: residual += x), weight [H] ->
    rms_norm(residual or x) * weight [T, H], the normalised rows rounded before the weight."""
    if residual is not None:
        x = residual.add_(x)
    return F.rms_norm(x, (x.shape[-1],), None, eps).mul_(weight)


def silu_mul(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """gate_up [T, 2 * inner] (gate columns first) -> silu(gate) * up [T, inner]; gate_up is clobbered."""
    gate, up = gate_up.split(inner, dim=-1)
    return F.silu(gate, inplace=True) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hs], cos_full / sin_signed [T, 1, hs] (RotaryEmbedding.lookup) -> rotated copy:
    x * cos_full + [x2 | x1] * sin_signed."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, heads, hs / 2] each
    swapped = torch.cat([x2, x1], dim=-1)  # [T, heads, hs]
    return (x * cos).add_(swapped.mul_(sin))


def rotary_write_kv(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """qkv [T, (nh + 2 kvh) hs] (query, key, value heads): query and key heads rotated in place by the
    table rows cos_sin[positions] ([P, 2 hs]: cos_full then sin_signed); then row t's key and value
    written into slot slot_mapping[t] of key_cache / value_cache [num_blocks, block_size, kvh, hs]
    (-1: skipped). Caches in the model's dtype or float32."""
    from pagedserve.kernels.cache.reference import write_kv_cache_ref

    head_size = key_cache.shape[-1]
    num_tokens = qkv.shape[0]
    rows = cos_sin.index_select(0, positions).unsqueeze(1)  # [T, 1, 2 hs]
    cos, sin = rows.chunk(2, dim=-1)
    qk_width = (num_heads + num_kv_heads) * head_size
    qk = qkv[:, :qk_width].view(num_tokens, num_heads + num_kv_heads, head_size)
    qk.copy_(rotate(qk, cos, sin))
    key = qk[:, num_heads:]
    value = qkv[:, qk_width:].view(num_tokens, num_kv_heads, head_size)
    write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping)
