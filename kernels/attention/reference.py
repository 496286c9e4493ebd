"""Plain-torch paged attention: the reference for the Triton kernel and the CPU path.

The batch is flattened over tokens. Sequence i owns query rows
query_start_loc[i] : query_start_loc[i + 1]; they are its last q_len_i tokens, so their positions are
seq_lens[i] - q_len_i ... seq_lens[i] - 1 (a decode has q_len 1, a prefill chunk many). Keys and
values of all seq_lens[i] positions are read from the paged cache through block_tables[i]
(the new tokens' K/V are written into the cache before attention runs):

    cache block b = block_tables[i][pos // block_size], slot pos % block_size
    query row j of sequence i attends to positions max(0, p_j - window + 1) ... p_j  (causal)

Cached K and V are read as float32 times k_scale and v_scale (1.0 except for fp8 caches that
store scaled values, see kv_cache_dtype).
"""

from __future__ import annotations

import torch


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    seq_lens_list = seq_lens.tolist()
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens_list):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, key_cache.shape[3])[:seq_len]  # [seq_len, kvh, hs]
        v = value_cache[blocks].reshape(-1, num_kv_heads, value_cache.shape[3])[:seq_len]
        q = query[q_start:q_end]  # [q_len, nh, hs]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
        k_pos = torch.arange(seq_len, device=query.device)  # [seq_len]
        allowed = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        k = k.float().repeat_interleave(group, dim=1) * k_scale  # [seq_len, nh, hs]
        v = v.float().repeat_interleave(group, dim=1) * v_scale
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [nh, q_len, seq_len]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
