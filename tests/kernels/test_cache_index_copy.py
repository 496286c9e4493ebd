"""write_kv_cache_index_copy against the reference: with and without padding slots, every dtype, and a
key that is a strided view (as the model passes it)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cache.index_copy import slot_mapping_has_padding, write_kv_cache_index_copy
from pagedserve.kernels.cache.reference import write_kv_cache_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("has_padding", [False, True])
@pytest.mark.parametrize("checked_by_caller", [False, True])
def test_matches_the_reference(dtype, has_padding, checked_by_caller):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_size, num_tokens = 40, 16, 2, 64, 37
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_size, generator=gen)  # fp32 new K/V, cast on write
    key, value = fused[:, 0], fused[:, 2]  # [T, kvh, hs] strided views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # [T]
    if has_padding:
        slots[::5] = -1
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    write_kv_cache_ref(key, value, expected_key, expected_value, slots)
    checked = slot_mapping_has_padding(slots) if checked_by_caller else None  # as a step checks it once
    assert checked in (None, has_padding)
    write_kv_cache_index_copy(key, value, key_cache, value_cache, slots, has_padding=checked)
    torch.testing.assert_close(key_cache, expected_key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_value, atol=0, rtol=0)


def test_no_tokens_is_a_no_op():
    cache = torch.randn(2, 8, 1, 64)
    before = cache.clone()
    write_kv_cache_index_copy(cache[0, :0], cache[0, :0], cache, cache, torch.zeros(0, dtype=torch.int64))
    torch.testing.assert_close(cache, before, atol=0, rtol=0)
