"""The larger grid, compiled on a GPU: every GQA ratio x head size x block size x dtype x split mode,
long contexts, and pools whose real offsets pass 2^31 elements."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedserve.kernels.cache.reference import copy_blocks_ref, swap_blocks_ref, write_kv_cache_ref
from pagedserve.kernels.attention.reference import paged_attention_ref

if not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need a CUDA device", allow_module_level=True)
pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PAGED_ATTENTION = "pagedserve.kernels.attention.triton_kernel:paged_attention"
LONG_MIXED = [(2000, 1), (513, 1), (0, 1), (100, 37), (0, 300), (1500, 64), (7, 0), (4095, 1)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize(("group", "head_size", "block_size", "dtype", "num_kv_splits"), list(itertools.product(
    [1, 2, 4, 8], [64, 80, 96, 128], [8, 16, 32], DTYPES, [1, 4, None])))
def test_paged_attention_grid(kernels, paged_batch, assert_matches, group, head_size, block_size, dtype,
                              num_kv_splits):
    num_kv_heads = 1 if group == 8 else 2  # group 8 over a single KV head: MQA
    batch = paged_batch(LONG_MIXED, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                        head_size=head_size, block_size=block_size, dtype=dtype)
    scale = head_size ** -0.5
    out = kernels.call(PAGED_ATTENTION, *batch.args(), scale, None, num_kv_splits=num_kv_splits)
    assert_matches(out, paged_attention_ref(*batch.args(), scale))


@pytest.mark.parametrize(("group", "dtype", "sliding_window", "num_kv_splits"), list(itertools.product(
    [1, 4], DTYPES, [1, 33, 256, 4096], [1, 3])))
def test_sliding_window_grid(kernels, paged_batch, assert_matches, group, dtype, sliding_window, num_kv_splits):
    batch = paged_batch(LONG_MIXED, num_heads=2 * group, num_kv_heads=2, head_size=128, block_size=16, dtype=dtype)
    out = kernels.call(PAGED_ATTENTION, *batch.args(), 0.088, sliding_window, num_kv_splits=num_kv_splits)
    assert_matches(out, paged_attention_ref(*batch.args(), 0.088, sliding_window))


@pytest.mark.parametrize("num_seqs", [1, 2, 64, 256])
def test_decode_batches_with_automatic_splits(kernels, paged_batch, assert_matches, num_seqs):
    lengths = torch.randint(1, 8192, (num_seqs,), generator=torch.Generator().manual_seed(num_seqs)).tolist()
    batch = paged_batch([(n, 1) for n in lengths], num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                        dtype=torch.bfloat16)
    out = kernels.call(PAGED_ATTENTION, *batch.args(), 0.088)
    assert_matches(out, paged_attention_ref(*batch.args(), 0.088))


def test_small_batches_are_split():
    from pagedserve.kernels.attention.triton_kernel import choose_num_kv_splits

    device = torch.device("cuda")
    assert choose_num_kv_splits(num_programs=2, max_context=8192, device=device) > 1
    assert choose_num_kv_splits(num_programs=100_000, max_context=8192, device=device) == 1
    assert choose_num_kv_splits(num_programs=2, max_context=32, device=device) == 1


def test_offsets_beyond_2_pow_31_in_a_real_pool(kernels, paged_batch, assert_matches):
    # 16 x 8 x 128 elements per block: block ids from 2^17 on put offsets past 2^31 (two 4.3 GB caches)
    min_block_id = 2 ** 31 // (16 * 8 * 128) + 1
    batch = paged_batch([(700, 1), (90, 40)], num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                        dtype=torch.float16, num_blocks=min_block_id + 64, min_block_id=min_block_id)
    for num_kv_splits in (1, 4):
        out = kernels.call(PAGED_ATTENTION, *batch.args(), 0.088, num_kv_splits=num_kv_splits)
        assert_matches(out, paged_attention_ref(*batch.args(), 0.088))
    key = torch.randn(5, 8, 128, device="cuda", dtype=torch.float16)  # [5, kvh, hs]
    slot_mapping = torch.tensor([min_block_id * 16 + 3, -1, (min_block_id + 63) * 16 + 15, -1, 7], device="cuda")
    expected_key, expected_value = batch.key_cache.clone(), batch.value_cache.clone()
    write_kv_cache_ref(key, key, expected_key, expected_value, slot_mapping)
    kernels.call("pagedserve.kernels.cache.triton_kernel:write_kv_cache", key, key, batch.key_cache, batch.value_cache,
                 slot_mapping)
    mapping = torch.tensor([[min_block_id + 63, min_block_id + 62], [0, min_block_id + 61]], device="cuda")
    copy_blocks_ref([expected_key], [expected_value], mapping)
    kernels.call("pagedserve.kernels.cache.triton_kernel:copy_blocks", [batch.key_cache], [batch.value_cache], mapping)
    touched = torch.tensor([0, min_block_id, min_block_id + 61, min_block_id + 62, min_block_id + 63], device="cuda")
    torch.testing.assert_close(batch.key_cache[touched], expected_key[touched], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.value_cache[touched], expected_value[touched], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_between_gpu_and_pinned_host(dtype):
    from pagedserve.kernels.cache.triton_kernel import swap_blocks

    gpu_cache = torch.randn(64, 16, 8, 128, device="cuda").to(dtype)  # [64, 16, 8, 128]
    host_cache = torch.zeros(32, 16, 8, 128, dtype=dtype).pin_memory()  # [32, 16, 8, 128]
    out_mapping = torch.tensor([[5, 0], [6, 1], [7, 2], [40, 9], [3, 31]])  # [5, 2] (gpu, host)
    swap_blocks(gpu_cache, host_cache, out_mapping)
    torch.cuda.synchronize()
    expected_host = torch.zeros(32, 16, 8, 128, dtype=dtype)
    swap_blocks_ref(gpu_cache, expected_host, out_mapping)
    torch.testing.assert_close(host_cache, expected_host, atol=0, rtol=0)

    in_mapping = torch.tensor([[0, 60], [1, 61], [9, 10], [31, 11]])  # [4, 2] (host, gpu)
    expected_gpu = gpu_cache.clone()
    swap_blocks_ref(host_cache, expected_gpu, in_mapping)
    swap_blocks(host_cache, gpu_cache, in_mapping)
    torch.cuda.synchronize()
    torch.testing.assert_close(gpu_cache, expected_gpu, atol=0, rtol=0)
