"""Triton KV-cache writes and block copies, and the block swap, against the plain-torch references."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cache.reference import copy_blocks_ref, swap_blocks_ref, write_kv_cache_ref

WRITE_KV_CACHE = "pagedserve.kernels.cache.triton_kernel:write_kv_cache"
COPY_BLOCKS = "pagedserve.kernels.cache.triton_kernel:copy_blocks"
COPY_BLOCK_RUNS = "pagedserve.kernels.cache.triton_kernel:copy_block_runs"
SWAP_BLOCKS = "pagedserve.kernels.cache.triton_kernel:swap_blocks"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)  # [nb, bs, kvh, hs]
    return cache.to(device=device, dtype=dtype)


@pytest.mark.parametrize(("num_kv_heads", "head_size", "block_size", "dtype", "source_dtype"), [
    (1, 64, 8, F16, F16),
    (3, 80, 16, BF16, BF16),  # head count and head size both padded in the kernel
    (8, 128, 32, F32, F32),
    (2, 96, 16, F16, F32),  # float32 activations stored into a float16 cache
])
def test_write_kv_cache(kernels, device, num_kv_heads, head_size, block_size, dtype, source_dtype):
    num_blocks, num_tokens = 12, 40
    gen = torch.Generator().manual_seed(1)
    # keys and values as views of one fused projection output: strided, not contiguous
    qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_size, generator=gen).to(device=device, dtype=source_dtype)
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 3 * num_kv_heads:]  # [T, kvh, hs] each
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # [T] distinct slots
    slot_mapping[::7] = -1  # padding tokens
    slot_mapping = slot_mapping.to(device)
    key_cache = random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device, seed=2)
    value_cache = random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device, seed=3)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    write_kv_cache_ref(key, value, expected_key, expected_value, slot_mapping)

    kernels.call(WRITE_KV_CACHE, key, value, key_cache, value_cache, slot_mapping)

    assert not torch.equal(expected_key, random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype,
                                                      device, seed=2)), "the batch wrote nothing"
    torch.testing.assert_close(key_cache, expected_key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_value, atol=0, rtol=0)


def test_write_kv_cache_rejects_mismatched_shapes(kernels, device):
    key = torch.zeros(4, 2, 64, device=device)
    cache = torch.zeros(8, 16, 2, 64, device=device)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.call(WRITE_KV_CACHE, key, key, cache, cache, torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.call(WRITE_KV_CACHE, key[:, :1], key[:, :1], cache, cache,
                     torch.zeros(4, dtype=torch.int64, device=device))


@pytest.mark.parametrize(("num_layers", "num_kv_heads", "head_size", "block_size", "dtype"), [
    (3, 2, 64, 16, F16),
    (2, 3, 80, 16, BF16),  # 3840 elements per block: the last chunk is partial
    (1, 1, 128, 8, F32),
])
def test_copy_blocks_all_layers(kernels, device, num_layers, num_kv_heads, head_size, block_size, dtype):
    num_blocks = 10
    key_caches = [random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device, seed=i)
                  for i in range(num_layers)]
    value_caches = [random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device, seed=100 + i)
                    for i in range(num_layers)]
    block_mapping = torch.tensor([[0, 7], [3, 4], [3, 9], [8, 1]], device=device)  # [4, 2] (src, dst)
    expected_keys = [c.clone() for c in key_caches]
    expected_values = [c.clone() for c in value_caches]
    copy_blocks_ref(expected_keys, expected_values, block_mapping)

    kernels.call(COPY_BLOCKS, key_caches, value_caches, block_mapping)

    for actual, expected in zip(key_caches + value_caches, expected_keys + expected_values):
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    torch.testing.assert_close(key_caches[0][7], key_caches[0][0], atol=0, rtol=0)


def test_copy_blocks_rejects_non_contiguous_caches(kernels, device):
    cache = torch.zeros(8, 16, 4, 64, device=device)[:, :, :2]  # [8, 16, 2, 64] with a head stride of 4
    with pytest.raises(ValueError, match="contiguous"):
        kernels.call(COPY_BLOCKS, [cache], [cache], torch.tensor([[0, 1]], device=device))


def test_copy_blocks_empty_mapping_is_a_no_op(kernels, device):
    cache = random_cache(4, 8, 1, 64, F16, device)
    before = cache.clone()
    kernels.call(COPY_BLOCKS, [cache], [cache], torch.zeros(0, 2, dtype=torch.int64, device=device))
    torch.testing.assert_close(cache, before, atol=0, rtol=0)


@pytest.mark.parametrize("block_mapping", [
    [[0, 5], [1, 6], [2, 7], [9, 0]],  # one run of three and a single block
    [[4, 2], [3, 3], [7, 8], [8, 9]],  # descending sources break runs
])
def test_copy_block_runs_matches_indexed_swap(kernels, device, block_mapping):
    src = random_cache(10, 16, 2, 64, BF16, "cpu", seed=4)
    dst = random_cache(10, 16, 2, 64, BF16, "cpu", seed=5)
    expected = dst.clone()
    swap_blocks_ref(src, expected, torch.tensor(block_mapping))
    kernels.call(COPY_BLOCK_RUNS, src, dst, torch.tensor(block_mapping))
    torch.testing.assert_close(dst, expected, atol=0, rtol=0)


def test_swap_blocks_within_one_device(kernels, device):
    src = random_cache(6, 8, 1, 64, F16, device, seed=6)
    dst = random_cache(6, 8, 1, 64, F16, device, seed=7)
    mapping = torch.tensor([[5, 0], [0, 5], [2, 3]])  # [3, 2], on the CPU as the worker passes it
    expected = dst.clone()
    swap_blocks_ref(src, expected, mapping)
    kernels.call(SWAP_BLOCKS, src, dst, mapping)
    torch.testing.assert_close(dst, expected, atol=0, rtol=0)


def test_int64_offsets_in_a_4_gib_pool(interpreter, tmp_path):
    """Block ids above 2^20 whose offsets pass 2^31 elements (see kernel_sparse_pool.py)."""
    pool = str(tmp_path / "pool.bin")
    written, expected = interpreter.call("kernel_sparse_pool:write", pool)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(written, expected, atol=0, rtol=0)
    copied, expected = interpreter.call("kernel_sparse_pool:copy", pool)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(copied, expected, atol=0, rtol=0)
