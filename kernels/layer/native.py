"""ctypes wrappers of the fused per-layer CPU kernels in kernels/native (RMSNorm with the residual
add, SiLU-mul, RoPE with the K/V cache write); references with the same meaning in layer/reference.py.

`supports_*` say whether a call qualifies (CPU, float32 or bfloat16, the layouts the C code
assumes): they return the library (to pass to the wrapper, sparing a second lookup) or None;
ops.py checks them and otherwise runs the reference. The wrappers check nothing more and trust
their arguments: a wrong stride would read out of bounds.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.native import library as native_lib
from pagedserve.kernels.native.abi import DTYPE_CODES
# RMSNorm and SiLU-mul take only bfloat16: there the kernels equal torch bit for bit. In float32
# torch's vectorised sum of squares and its exp round differently in the last place, and float32
# is the dtype of the exact-equality tests against Hugging Face, so float32 keeps torch's ops.
# RoPE with the K/V write is exact in both.
EXACT_DTYPES = (torch.bfloat16,)
MAX_HEAD_SIZE = 512  # rotary_write_kv keeps one head on the stack


def library():
    return native_lib.load()


def _qualifies(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in DTYPE_CODES


def supports_rows(x: torch.Tensor, weight: torch.Tensor):
    """x [T, H] contiguous with weight [H], both bfloat16 on the CPU (see EXACT_DTYPES)."""
    return (x.dtype in EXACT_DTYPES and _qualifies(x) and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype
            and weight.is_contiguous() and library() or None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 lib=None) -> torch.Tensor:
    out = torch.empty_like(x)
    num_tokens, hidden = x.shape
    (lib or library()).add_rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                           out.data_ptr(), num_tokens, hidden, eps, DTYPE_CODES[x.dtype], residual is not None)
    return out


def supports_silu_mul(gate_up: torch.Tensor):
    return (gate_up.dtype in EXACT_DTYPES and _qualifies(gate_up) and gate_up.dim() == 2 and gate_up.stride(1) == 1
            and library() or None)


def silu_mul(gate_up: torch.Tensor, inner: int, lib=None) -> torch.Tensor:
    num_tokens = gate_up.shape[0]
    out = torch.empty(num_tokens, inner, dtype=gate_up.dtype, device=gate_up.device)
    (lib or library()).silu_mul(gate_up.data_ptr(), out.data_ptr(), num_tokens, inner, gate_up.stride(0),
                       DTYPE_CODES[gate_up.dtype])
    return out


def supports_rotary_write_kv(qkv: torch.Tensor, cos_sin: torch.Tensor, key_cache: torch.Tensor):
    """qkv [T, width] with unit column stride, the table in qkv's dtype, caches contiguous in qkv's
    dtype or float32."""
    return (_qualifies(qkv) and qkv.dim() == 2 and qkv.stride(1) == 1 and cos_sin.dtype == qkv.dtype
            and cos_sin.is_contiguous() and key_cache.dtype in (qkv.dtype, torch.float32)
            and key_cache.is_contiguous() and key_cache.shape[-1] <= MAX_HEAD_SIZE and library() or None)


def rotary_write_kv(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                    lib=None) -> None:
    """positions and slot_mapping [T] int64 contiguous."""
    num_blocks, block_size, _, head_size = key_cache.shape
    (lib or library()).rotary_write_kv(qkv.data_ptr(), cos_sin.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
                              key_cache.data_ptr(), value_cache.data_ptr(), qkv.shape[0], num_heads, num_kv_heads,
                              head_size, qkv.stride(0), num_blocks * block_size, DTYPE_CODES[qkv.dtype],
                              DTYPE_CODES[key_cache.dtype])
