"""Plain-torch KV-cache operations: the reference for the Triton kernels and the CPU path.

Cache layout, one tensor for keys and one for values per layer:
    [num_blocks, block_size, num_kv_heads, head_size]; slot s = block_id * block_size + offset.

The cache may hold a narrower dtype than the new K/V (fp8 with a per-layer scale, see
kv_cache_dtype): writes convert with `to_cache_dtype`; copies and swaps move raw values.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cache.kv_dtype import to_cache_dtype


def write_kv_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
    k_scale: float = 1.0,  # fp8 caches store key / k_scale
    v_scale: float = 1.0,
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_size)[slots] = to_cache_dtype(key[valid], key_cache.dtype, k_scale)
    value_cache.view(-1, num_kv_heads, head_size)[slots] = to_cache_dtype(value[valid], value_cache.dtype, v_scale)


def copy_blocks_ref(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_size]
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src, dst) on the same device
) -> None:
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for key_cache, value_cache in zip(key_caches, value_caches):
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]


def swap_blocks_ref(
    src_cache: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_size]
    dst_cache: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_size]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src block, dst block), on the CPU
) -> None:
    """Moves whole blocks between devices (GPU<->CPU swap) or within one.

    The copy is synchronous: a non_blocking device-to-host copy could still be in flight when the
    host-side index assignment reads it.
    """
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(src_cache.device)
    dst = block_mapping[:, 1].to(dst_cache.device)
    dst_cache[dst] = src_cache[src].to(dst_cache.device)
