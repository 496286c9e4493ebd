"""KV-cache writes for CPU tensors: the reference's result with one index_copy_ per cache.

write_kv_cache_ref selects the valid rows with a boolean mask (a nonzero and two gathers) on
every call; a step rarely has padding slots (-1), so when there are none the new K/V rows are
copied straight into their slots (as raw bytes for fp8 caches: index_copy_ has no float8 CPU
kernel). Every layer of a step writes through the same slot_mapping, so the caller may check it
once (slot_mapping_has_padding) and pass the answer. Tested against the reference in tests/kernels.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cache.reference import write_kv_cache_ref
from pagedserve.kernels.cache.kv_dtype import raw_bytes, to_cache_dtype


def write_kv_cache_index_copy(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
    k_scale: float = 1.0,  # fp8 caches store key / k_scale
    v_scale: float = 1.0,
    has_padding: bool | None = None,  # slot_mapping_has_padding(slot_mapping); computed when None
) -> None:
    if has_padding is None:
        has_padding = slot_mapping_has_padding(slot_mapping)
    if has_padding:
        write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    for new, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        raw_bytes(cache).view(-1, num_kv_heads, head_size).index_copy_(
            0, slot_mapping, raw_bytes(to_cache_dtype(new, cache.dtype, scale)))


def slot_mapping_has_padding(slot_mapping: torch.Tensor) -> bool:
    """slot_mapping [num_tokens] -> True when it is empty or holds a -1 (the reference's path)."""
    return slot_mapping.numel() == 0 or bool((slot_mapping < 0).any())
