"""The KV cache's storage dtype, and the conversions on write (quantize) and read (dequantize).

    auto        the model's dtype
    float32, bfloat16, float16
    fp8_e4m3    torch.float8_e4m3fn: 3 mantissa bits, finite range +-448
    fp8_e5m2    torch.float8_e5m2:   2 mantissa bits, range +-57344

An fp8 cache stores K / k_scale and V / v_scale, with one k_scale and one v_scale per layer:

    write   cache = fp8(clamp(x / scale, -max, max))      (saturating: no inf, no NaN)
    read    x ~= float(cache) * scale

The scales default to 1.0 and stay fixed for the life of the cache, so a sequence's cached K/V
and so its tokens never depend on what else ran first (a scale calibrated on the first live
prefill would make every later output depend on that request). Scales calibrated on a fixed
prefill (pagedserve.testing.kv_scales) gain little over 1.0, and e5m2 loses more than e4m3 either
way: its two mantissa bits, not its range, are the limit (bench/quant_accuracy.py;
docs/quantization.md has the figures). Attention folds the scales in at no cost:
k_scale into the softmax scale, v_scale into the output (PagedAttention.k_scale / v_scale).

Block swaps and copy-on-write move a cache's raw bytes (any dtype); CPU ops that lack float8
kernels (index_copy_) run on uint8 views.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class KVCacheDtypeError(ValueError):
    pass


def resolve_kv_cache_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """auto -> the model's dtype; otherwise one of KV_CACHE_DTYPES."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise KVCacheDtypeError(f"kv cache dtype must be auto, {', '.join(KV_CACHE_DTYPES)}; not {name!r}")
    return KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """New K or V rows in the cache's dtype: scaled and saturated for fp8, a plain cast otherwise."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    x = x.to(torch.float32) if x.dtype != torch.float32 else x
    if scale != 1.0:
        x = x / scale
    limit = fp8_max(cache_dtype)
    return x.clamp(-limit, limit).to(cache_dtype)


def raw_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 cache (for ops without float8 CPU kernels); other caches unchanged."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
