"""KV-cache writes for CPU tensors: the reference's result with one index_copy_ per cache.

write_kv_cache_ref selects the valid rows with a boolean mask (a nonzero and two gathers) on
every call; a step rarely has padding slots (-1), so when there are none the new K/V rows are
copied straight into their slots. Tested against the reference in tests/kernels.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cache_ops_ref import write_kv_cache_ref


def write_kv_cache_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
) -> None:
    if slot_mapping.numel() == 0 or bool((slot_mapping < 0).any()):
        write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping)
        return
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value.to(value_cache.dtype))
