"""fp8 KV caches: writes (quantize, saturate), reads (dequantize inside attention) and block copies,
every path against the plain-torch references."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cache.index_copy import write_kv_cache_index_copy
from pagedserve.kernels.cache.reference import copy_blocks_ref, swap_blocks_ref, write_kv_cache_ref
from pagedserve.kernels.cache.kv_dtype import (
    KVCacheDtypeError,
    fp8_max,
    resolve_kv_cache_dtype,
    to_cache_dtype,
)
from pagedserve.kernels.attention.sdpa import paged_attention_sdpa
from pagedserve.kernels.attention.reference import paged_attention_ref
from tests.kernels.conftest import build_paged_batch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
WRITE_KV_CACHE = "pagedserve.kernels.cache.triton_kernel:write_kv_cache"
COPY_BLOCKS = "pagedserve.kernels.cache.triton_kernel:copy_blocks"
PAGED_ATTENTION = "pagedserve.kernels.attention.triton_kernel:paged_attention"
RELATIVE_STEP = {torch.float8_e4m3fn: 2 ** -4, torch.float8_e5m2: 2 ** -3}  # half an ulp, relative


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def test_names_resolve():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(KVCacheDtypeError, match="fp8_e4m3"):
        resolve_kv_cache_dtype("fp8", torch.float32)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_write_then_read_round_trips_within_half_an_ulp_and_saturates(dtype, scale):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 4
    x[:3] = torch.tensor([1e9, -1e9, float("inf")])
    stored = to_cache_dtype(x, dtype, scale)
    assert stored.dtype == dtype and not stored.float().isnan().any() and not stored.float().isinf().any()
    limit = fp8_max(dtype) * scale
    assert stored[:3].float().mul(scale).tolist() == [limit, -limit, limit]
    read = stored.float() * scale
    normal = x[3:].abs() > 2 ** -6 * scale  # above both formats' subnormal range
    error = ((read[3:] - x[3:]).abs() / x[3:].abs())[normal]
    assert error.max() <= RELATIVE_STEP[dtype] + 1e-6


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("has_padding", [False, True])
def test_cpu_write_matches_reference_bytes(dtype, has_padding):
    gen = torch.Generator().manual_seed(1)
    shape = (12, 16, 2, 64)
    key_cache = torch.zeros(shape, dtype=dtype)
    value_cache = torch.zeros(shape, dtype=dtype)
    fused = torch.randn(40, 3, 2, 64, generator=gen) * 10
    key, value = fused[:, 0], fused[:, 2]  # strided views, as the model passes them
    slots = torch.randperm(12 * 16, generator=gen)[:40]
    if has_padding:
        slots[::6] = -1
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    write_kv_cache_ref(key, value, expected_key, expected_value, slots, 0.5, 2.0)
    write_kv_cache_index_copy(key, value, key_cache, value_cache, slots, 0.5, 2.0)
    assert torch.equal(_bytes(key_cache), _bytes(expected_key))
    assert torch.equal(_bytes(value_cache), _bytes(expected_value))
    assert _bytes(key_cache).any()


def _fp8_batch(seqs, dtype, *, k_scale, v_scale, device=torch.device("cpu"), **options):
    """A paged batch whose caches hold fp8 (NaN in unused slots, as build_paged_batch makes them)."""
    batch = build_paged_batch(seqs, dtype=torch.float32, device=device, **options)
    batch.key_cache = to_cache_dtype(batch.key_cache * k_scale, dtype, k_scale)
    batch.value_cache = to_cache_dtype(batch.value_cache * v_scale, dtype, v_scale)
    return batch


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_sdpa_attention_reads_fp8_like_the_reference(dtype, query_dtype, sliding_window, assert_matches):
    seqs = [(0, 17), (40, 1), (15, 1), (3, 9), (63, 1), (31, 33)]
    batch = _fp8_batch(seqs, dtype, k_scale=0.5, v_scale=4.0, num_heads=8, num_kv_heads=2, head_size=64,
                       block_size=16)
    batch.query = batch.query.to(query_dtype)
    expected = paged_attention_ref(*batch.args(), 0.125, sliding_window, 0.5, 4.0)
    actual = paged_attention_sdpa(*batch.args(), 0.125, sliding_window, 0.5, 4.0)
    assert actual.dtype == query_dtype
    assert_matches(actual, expected)


def test_reference_attention_dequantizes_with_the_scales():
    """fp8 K/V times their scales equal the float32 K/V used directly (values exact in fp8)."""
    batch = build_paged_batch([(20, 3), (5, 1)], num_heads=4, num_kv_heads=2, head_size=32, block_size=8,
                              dtype=torch.float32, device=torch.device("cpu"))
    batch.key_cache = batch.key_cache.to(torch.float8_e4m3fn).float()  # values representable in fp8
    batch.value_cache = batch.value_cache.to(torch.float8_e4m3fn).float()
    expected = paged_attention_ref(*batch.args(), 0.2)
    fp8_batch = build_paged_batch([(20, 3), (5, 1)], num_heads=4, num_kv_heads=2, head_size=32, block_size=8,
                                  dtype=torch.float32, device=torch.device("cpu"))
    fp8_batch.key_cache = (batch.key_cache * 2).to(torch.float8_e4m3fn)  # stored / k_scale 0.5, still exact
    fp8_batch.value_cache = (batch.value_cache * 4).to(torch.float8_e4m3fn)  # stored / v_scale 0.25
    actual = paged_attention_ref(*fp8_batch.args(), 0.2, None, 0.5, 0.25)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("dtype", FP8)
def test_copies_and_swaps_move_raw_bytes(dtype):
    caches = [to_cache_dtype(torch.randn(6, 4, 2, 8, generator=torch.Generator().manual_seed(i)) * 50, dtype)
              for i in range(4)]
    mapping = torch.tensor([[0, 3], [2, 5]])
    keys, values = [c.clone() for c in caches[:2]], [c.clone() for c in caches[2:]]
    copy_blocks_ref(keys, values, mapping)
    for before, after in zip(caches, keys + values):
        assert torch.equal(_bytes(after[3]), _bytes(before[0])) and torch.equal(_bytes(after[5]), _bytes(before[2]))
    host = torch.zeros(4, 4, 2, 8, dtype=dtype)
    swap_blocks_ref(caches[0], host, torch.tensor([[1, 0], [4, 2]]))
    assert torch.equal(_bytes(host[0]), _bytes(caches[0][1])) and torch.equal(_bytes(host[2]), _bytes(caches[0][4]))


# Triton: compiled on CUDA, else the interpreter (see conftest.py).

@pytest.mark.parametrize("dtype", FP8)
def test_triton_write_matches_reference(kernels, device, dtype):
    """Inputs are fp8 values times the scale (plus out-of-range ones), so no rounding is involved:
    the interpreter's float8 rounding differs from torch's where rounding carries into the exponent,
    which CUDA's conversion does not."""
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, num_kv_heads, head_size = 6, 16, 2, 64
    key = to_cache_dtype(torch.randn(30, num_kv_heads, head_size, generator=gen) * 8, dtype).float() * 0.5
    value = to_cache_dtype(torch.randn(30, num_kv_heads, head_size, generator=gen), dtype).float() * 2.0
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 1e9, -3e7])  # saturate
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:30]
    slots[::7] = -1
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    write_kv_cache_ref(key, value, expected_key, expected_value, slots, 0.5, 2.0)
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    kernels.call(WRITE_KV_CACHE, key.to(device), value.to(device), key_cache, value_cache, slots.to(device), 0.5, 2.0)
    assert torch.equal(_bytes(key_cache.cpu()), _bytes(expected_key))
    assert torch.equal(_bytes(value_cache.cpu()), _bytes(expected_value))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_triton_attention_reads_fp8(kernels, device, dtype, num_kv_splits, assert_matches):
    seqs = [(0, 17), (40, 1), (15, 1), (3, 9), (63, 1)]
    batch = _fp8_batch(seqs, dtype, k_scale=0.5, v_scale=4.0, device=device, num_heads=4, num_kv_heads=2,
                       head_size=32, block_size=16)
    out = kernels.call(PAGED_ATTENTION, *batch.args(), 0.2, None, 0.5, 4.0, num_kv_splits=num_kv_splits)
    cpu_args = [tensor.cpu() for tensor in batch.args()]
    assert_matches(out, paged_attention_ref(*cpu_args, 0.2, None, 0.5, 4.0))


def test_triton_copy_blocks_moves_fp8_bytes(kernels, device):
    caches = [to_cache_dtype(torch.randn(8, 16, 2, 32, generator=torch.Generator().manual_seed(i)), FP8[0])
              for i in range(4)]
    mapping = torch.tensor([[0, 7], [3, 4]])
    expected = [c.clone() for c in caches]
    copy_blocks_ref(expected[:2], expected[2:], mapping)
    on_device = [c.to(device) for c in caches]
    kernels.call(COPY_BLOCKS, on_device[:2], on_device[2:], mapping.to(device))
    for actual, wanted in zip(on_device, expected):
        assert torch.equal(_bytes(actual.cpu()), _bytes(wanted))
