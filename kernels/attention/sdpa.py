"""Paged attention for CPU tensors: batched decodes and per-sequence prefill chunks on torch SDPA.

Same signature (plus an optional plan, below) and result as paged_attention_ref (the oracle in
tests), with far fewer torch calls; it runs on any device, but CUDA has the Triton kernel. The reference's einsums over a per-sequence repeat_interleave of K/V cost one round of
small ops per sequence and layer; here the batch is split by query length:

    decodes (q_len 1)   sorted by context length, cut into chunks of about DECODE_CHUNK_ROWS
                        K/V rows; each chunk gathers its blocks with one index_select per
                        cache into [chunk, L, kvh, hs] (L = the chunk's longest context, padded
                        to whole blocks; padding positions read the sequence's first slot), and runs one
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

All of this (sorting, chunking, slots, masks, query rows) depends only on block_tables, seq_lens
and query_start_loc, which every layer of a step shares: plan_sdpa_attention builds it once (a
SdpaAttentionPlan; the worker keeps it on the step's AttentionMetadata) and each layer's call
passes it back, so a layer runs only the gathers, SDPA and the output copy. A decode-only batch
in one chunk whose rows are already in order (one sequence, or equal lengths) reads its queries
as a view and returns SDPA's output as the result.

Sorting keeps a chunk's contexts close in length, so padding is small; a chunk's K/V (about
2 MB in float32) stays in the cache between the gather and SDPA. Padding positions read a written
slot and are masked, because unused cache slots may hold anything, NaN included, and 0 x NaN is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DECODE_CHUNK_ROWS = 2048  # K rows (tokens) gathered per decode chunk, padding included


@dataclass(frozen=True, slots=True)
class DecodeChunk:
    """Decodes attended by one SDPA call, longest context first."""

    q_rows: torch.Tensor | slice  # [c] int64 query rows; a slice when consecutive and in order
    num_rows: int  # c
    slots: torch.Tensor  # [c * L] int64 cache slot of every context position (padding reads position 0)
    width: int  # L: the chunk's longest context
    mask: torch.Tensor | None  # [c, 1, 1, L] bool; None when nothing is padded and there is no window


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence with more than one query row."""

    q_start: int
    q_len: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [1, 1, q_len, seq_len] bool; None: the whole context is new (is_causal)


@dataclass(frozen=True, slots=True)
class SdpaAttentionPlan:
    """What paged_attention_sdpa derives from block_tables, seq_lens and query_start_loc for one block
    size and sliding window. covers_all_rows: the batch is one decode chunk over rows 0..T-1 in
    order, so SDPA's output is the result with no copy."""

    decodes: tuple[DecodeChunk, ...]
    prefills: tuple[PrefillChunk, ...]
    covers_all_rows: bool


def plan_sdpa_attention(
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    block_size: int,
    sliding_window: int | None = None,
) -> SdpaAttentionPlan:
    seq_lens_list = seq_lens.tolist()
    starts = query_start_loc.tolist()
    decode_rows: list[int] = []  # sequence indexes with one query row
    prefills = []
    for i, seq_len in enumerate(seq_lens_list):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            decode_rows.append(i)
        elif q_len > 1:
            prefills.append(_plan_prefill(block_tables[i], starts[i], q_len, seq_len, block_size, sliding_window))
    decodes = (_plan_decodes(block_tables, decode_rows, seq_lens_list, starts, block_size, sliding_window)
               if decode_rows else ())
    covers_all_rows = (not prefills and len(decodes) == 1 and isinstance(decodes[0].q_rows, slice)
                       and decodes[0].q_rows == slice(0, starts[-1]))
    return SdpaAttentionPlan(decodes, tuple(prefills), covers_all_rows)


def paged_attention_sdpa(
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
    plan: SdpaAttentionPlan | None = None,  # plan_sdpa_attention of these arguments; built here when None
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    if plan is None:
        plan = plan_sdpa_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[1], sliding_window)
    scale = scale * k_scale  # q . (k_scale k) = k_scale (q . k)
    if plan.covers_all_rows:
        out = _decode(query, key_cache, value_cache, plan.decodes[0], scale).reshape(query.shape)
        return out if v_scale == 1.0 else out.mul_(v_scale)
    out = torch.empty_like(query)
    for chunk in plan.prefills:
        _prefill(out, query, key_cache, value_cache, chunk, scale)
    for chunk in plan.decodes:
        result = _decode(query, key_cache, value_cache, chunk, scale).reshape(
            chunk.num_rows, query.shape[1], query.shape[2])  # [c, nh, hs]
        if isinstance(chunk.q_rows, slice):
            out[chunk.q_rows] = result
        else:
            out.index_copy_(0, chunk.q_rows, result)
    return out if v_scale == 1.0 else out.mul_(v_scale)


def attend_prefills(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    plan: SdpaAttentionPlan, scale: float, v_scale: float = 1.0) -> None:
    """Only the prefill chunks of plan, into their rows of out [T, nh, hs] (the native decode path's
    companion: pagedserve.kernels.attention.native attends the decodes)."""
    for chunk in plan.prefills:
        _prefill(out, query, key_cache, value_cache, chunk, scale)
        if v_scale != 1.0:
            out[chunk.q_start:chunk.q_start + chunk.q_len].mul_(v_scale)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_blocks, bs, kvh, hs], block_ids [n] -> [n * bs, kvh, hs] in dtype (a copy)."""
    return cache.index_select(0, block_ids).flatten(0, 1).to(dtype)


def _plan_prefill(block_table, q_start, q_len, seq_len, block_size, sliding_window) -> PrefillChunk:
    device = block_table.device
    block_ids = block_table[: -(-seq_len // block_size)].long()  # [blocks]
    mask = None
    if q_len != seq_len or sliding_window:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(seq_len, device=device)[None, :]  # [1, L]
        mask = k_pos <= q_pos  # [q_len, L]
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
        mask = mask[None, None]  # [1, 1, q_len, L]
    return PrefillChunk(q_start, q_len, seq_len, block_ids, mask)


def _prefill(out, query, key_cache, value_cache, chunk: PrefillChunk, scale) -> None:
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    q_start, q_end, seq_len = chunk.q_start, chunk.q_start + chunk.q_len, chunk.seq_len
    k = _gather(key_cache, chunk.block_ids, query.dtype)[:seq_len].transpose(0, 1)  # [kvh, L, hs]
    v = _gather(value_cache, chunk.block_ids, query.dtype)[:seq_len].transpose(0, 1)  # [kvh, L, hs]
    q = query[q_start:q_end].transpose(0, 1)  # [nh, q_len, hs]
    result = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale,
        enable_gqa=num_heads != num_kv_heads)  # [1, nh, q_len, hs]
    out[q_start:q_end] = result[0].transpose(0, 1)


def _plan_decodes(block_tables, rows, seq_lens, starts, block_size, sliding_window) -> tuple[DecodeChunk, ...]:
    device = block_tables.device
    rows = sorted(rows, key=lambda row: seq_lens[row], reverse=True)
    lens_list = [seq_lens[row] for row in rows]
    max_len = lens_list[0]
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
    q_starts = [starts[row] for row in rows]
    chunks = []
    begin = 0
    while begin < len(rows):
        width = lens_list[begin]
        end = begin + max(1, min(len(rows) - begin, DECODE_CHUNK_ROWS // width))
        mask = None
        if lens_list[end - 1] < width or sliding_window:
            mask = allowed[begin:end, None, None, :width].contiguous()  # [c, 1, 1, L]
        first = q_starts[begin]
        if q_starts[begin:end] == list(range(first, first + end - begin)):
            q_rows = slice(first, first + end - begin)
        else:
            q_rows = torch.tensor(q_starts[begin:end], device=device)  # [c]
        chunks.append(DecodeChunk(q_rows, end - begin, slots[begin:end, :width].reshape(-1), width, mask))
        begin = end
    return tuple(chunks)


def _decode(query, key_cache, value_cache, chunk: DecodeChunk, scale) -> torch.Tensor:
    """-> [c, kvh, g, hs]: the query heads of a KV group are that group's query rows."""
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    shape = (chunk.num_rows, chunk.width, num_kv_heads, head_size)
    k = key_cache.view(-1, num_kv_heads, head_size).index_select(0, chunk.slots).view(shape).to(
        query.dtype)  # [c, L, kvh, hs]
    v = value_cache.view(-1, num_kv_heads, head_size).index_select(0, chunk.slots).view(shape).to(query.dtype)
    if isinstance(chunk.q_rows, slice):
        q = query[chunk.q_rows]  # [c, nh, hs]
    else:
        q = query.index_select(0, chunk.q_rows)
    q = q.view(chunk.num_rows, num_kv_heads, group, head_size)  # [c, kvh, g, hs]
    return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=chunk.mask,
                                          scale=scale)  # [c, kvh, g, hs]
