"""Paged attention for CPU tensors: batched decodes and per-sequence prefill chunks on torch SDPA.

Same signature and result as paged_attention_ref (the oracle in tests), with far fewer torch
calls; it runs on any device, but CUDA has the Triton kernel. The reference's einsums over a per-sequence repeat_interleave of K/V cost one round of
small ops per sequence and layer; here the batch is split by query length:

    decodes (q_len 1)   sorted by context length, cut into chunks of about DECODE_CHUNK_ROWS
                        K/V rows; each chunk gathers its blocks with one index_select per
                        cache into [chunk, L, kvh, hs] (L = the chunk's longest context, padded
                        to whole blocks), zeroes the padding, and runs one
                        scaled_dot_product_attention with the query heads of a KV group as
                        that group's query rows:
                            q [chunk, kvh, group, hs]  x  K [chunk, kvh, L, hs]  ->  [chunk, kvh, group, hs]
                        with a [chunk, 1, 1, L] mask for the padding (and a sliding window).
    prefill chunks      one SDPA per sequence over its gathered context; causal with
                        is_causal when the chunk is the whole context, else a bottom-right
                        aligned mask (the chunk's rows sit after a cached prefix):

                            key position     0 ........ L - q_len ........ L - 1
                            query row 0      x x x x x x x
                            query row q-1    x x x x x x x x x x x x x x x x x

A cache in another dtype than the query (fp8, or a bfloat16 cache under a float32 model) is
converted after the gather, on the gathered copy only; fp8 scales fold into SDPA's scale (k_scale)
and the output (v_scale).

Sorting keeps a chunk's contexts close in length, so padding is small; a chunk's K/V (about
2 MB in float32) stays in the cache between the gather and SDPA. Padded slots are zeroed
because unused cache slots may hold anything, NaN included, and 0 x NaN is NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DECODE_CHUNK_ROWS = 2048  # K rows (tokens) gathered per decode chunk, padding included


def paged_attention_cpu(
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
    out = torch.empty_like(query)
    scale = scale * k_scale  # q . (k_scale k) = k_scale (q . k)
    seq_lens_list = seq_lens.tolist()
    starts = query_start_loc.tolist()
    decode_rows: list[int] = []  # sequence indexes with one query row
    for i, seq_len in enumerate(seq_lens_list):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            decode_rows.append(i)
        elif q_len > 1:
            _prefill(out, query, key_cache, value_cache, block_tables[i], starts[i], q_len, seq_len, scale,
                     sliding_window)
    if decode_rows:
        _decodes(out, query, key_cache, value_cache, block_tables, decode_rows, seq_lens_list, starts, scale,
                 sliding_window)
    return out if v_scale == 1.0 else out.mul_(v_scale)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_blocks, bs, kvh, hs], block_ids [n] -> [n * bs, kvh, hs] in dtype (a copy)."""
    return cache.index_select(0, block_ids).flatten(0, 1).to(dtype)


def _prefill(out, query, key_cache, value_cache, block_table, q_start, q_len, seq_len, scale,
             sliding_window) -> None:
    block_size = key_cache.shape[1]
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    block_ids = block_table[: -(-seq_len // block_size)].long()  # [blocks]
    k = _gather(key_cache, block_ids, query.dtype)[:seq_len].transpose(0, 1)  # [kvh, L, hs]
    v = _gather(value_cache, block_ids, query.dtype)[:seq_len].transpose(0, 1)  # [kvh, L, hs]
    q = query[q_start:q_start + q_len].transpose(0, 1)  # [nh, q_len, hs]
    mask = None
    if q_len != seq_len or sliding_window:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]  # [1, L]
        mask = k_pos <= q_pos  # [q_len, L]
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
    result = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=None if mask is None else mask[None, None],
        is_causal=mask is None, scale=scale, enable_gqa=num_heads != num_kv_heads)  # [1, nh, q_len, hs]
    out[q_start:q_start + q_len] = result[0].transpose(0, 1)


def _decodes(out, query, key_cache, value_cache, block_tables, rows, seq_lens, starts, scale,
             sliding_window) -> None:
    block_size, num_kv_heads, head_size = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    rows = sorted(rows, key=lambda row: seq_lens[row], reverse=True)
    lens_list = [seq_lens[row] for row in rows]
    max_len = lens_list[0]
    device = query.device
    rows_index = torch.tensor(rows, device=device)  # [D], longest context first
    lens = torch.tensor(lens_list, device=device)  # [D]
    k_pos = torch.arange(max_len, device=device)  # [max_len]
    num_blocks = -(-max_len // block_size)
    tables = block_tables.index_select(0, rows_index)[:, :num_blocks].long()  # [D, blocks]
    offsets = torch.arange(block_size, device=device)  # [bs]
    slots = (tables[:, :, None] * block_size + offsets).view(len(rows), num_blocks * block_size)[
        :, :max_len]  # [D, max_len]: cache slot of every context position
    is_padding = k_pos[None, :] >= lens[:, None]  # [D, max_len]
    slots = torch.where(is_padding, slots[:, :1], slots)  # padding reads position 0 (written, finite)
    allowed = ~is_padding
    if sliding_window:
        allowed &= k_pos[None, :] > lens[:, None] - 1 - sliding_window
    q_index = torch.tensor([starts[row] for row in rows], device=device)  # [D]
    key_slots = key_cache.view(-1, num_kv_heads, head_size)  # [num_slots, kvh, hs]
    value_slots = value_cache.view(-1, num_kv_heads, head_size)
    begin = 0
    while begin < len(rows):
        width = lens_list[begin]  # L: the chunk's longest context
        end = begin + max(1, min(len(rows) - begin, DECODE_CHUNK_ROWS // width))
        num_chunk = end - begin
        chunk_slots = slots[begin:end, :width].reshape(-1)  # [c * L]
        k = key_slots.index_select(0, chunk_slots).view(num_chunk, width, num_kv_heads, head_size).to(
            query.dtype)  # [c, L, kvh, hs]
        v = value_slots.index_select(0, chunk_slots).view(num_chunk, width, num_kv_heads, head_size).to(query.dtype)
        mask = None
        if lens_list[end - 1] < width or sliding_window:
            mask = allowed[begin:end, None, None, :width]  # [c, 1, 1, L]
        chunk_q_index = q_index[begin:end]  # [c]
        q = query.index_select(0, chunk_q_index).view(num_chunk, num_kv_heads, group, head_size)  # [c, kvh, g, hs]
        result = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                                scale=scale)  # [c, kvh, g, hs]
        out.index_copy_(0, chunk_q_index, result.reshape(num_chunk, num_kv_heads * group, head_size))
        begin = end
