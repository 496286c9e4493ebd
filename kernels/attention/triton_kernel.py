"""Triton paged attention over a flattened batch of decodes and prefill chunks.

Same contract as `paged_attention_ref`: sequence i owns query rows
query_start_loc[i] : query_start_loc[i + 1], its last q_len_i tokens, at positions
context_len_i ... seq_len_i - 1 with context_len_i = seq_len_i - q_len_i.

Work split. One program takes BLOCK_Q query tokens of one sequence and the whole group of
GROUP = num_heads // num_kv_heads query heads that share one KV head, so each K/V tile is loaded
once per group and used for all BLOCK_M rows (BLOCK_M = 16 for decode-only batches, else 64, at
least GROUP rounded up to a power of two; BLOCK_Q = BLOCK_M // GROUP):

    Q tile, GROUP = 3, BLOCK_M = 16, BLOCK_Q = 5     KV tiles walked by the program,
    r0  tok0 h0   r1  tok0 h1   r2  tok0 h2          TILE_N positions each:
    r3  tok1 h0   r4  tok1 h1   r5  tok1 h2          |ctx ctx ctx ctx|ctx ctx new new|new --- |
    ...                                               tile 0          tile 1          tile 2
    r12 tok4 h0   r13 tok4 h1   r14 tok4 h2          position p lives in block
    r15 padding (masked)                             block_tables[i][p // block_size], slot p % block_size

Program ids over query blocks need no host sync: sequence i's query blocks start at
query_start_loc[i] // BLOCK_Q + i, so num_tokens // BLOCK_Q + num_seqs programs cover every
batch, each finds its sequence by binary search and surplus programs return at once.

Each program walks KV tiles from the first position its rows may see (the sliding window's
left edge, else 0) to its last row's position (causal), with an online softmax in fp32:

    m' = max(m, rowmax(S));  l' = l * 2^(m - m') + rowsum(2^(S - m'));  acc' = acc * 2^(m - m') + P V

Split-K. When the batch leaves most of the GPU idle (few sequences, long contexts) a third grid
axis cuts each program's tile range into num_kv_splits parts; each part stores (m, l, acc)
unnormalised in fp32 and a reduction kernel merges them:
out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s.

Addresses are int64 (block id * block stride), so large pools and big block ids do not overflow.
Caches in another dtype than the query (fp8 with per-layer scales, see kv_cache_dtype) are
converted per tile after the load: k_scale folds into the softmax scale, v_scale multiplies the
accumulator once at the end.
The Triton interpreter multiplies bfloat16 as raw bits, so under it bfloat16 tiles are widened
to float32 before tl.dot; float32 data uses IEEE dots rather than TF32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

IS_INTERPRETED = bool(triton.knobs.runtime.interpret)  # decided when the decorators below run
TILE_N = 32  # KV tokens per inner-loop step, independent of the cache block size
MAX_KV_SPLITS = 32
MIN_TILES_PER_SPLIT = 4
LOG2_E = 1.4426950408889634


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Last sequence i with query_start_loc[i] // BLOCK_Q + i <= q_block_id (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, v_scale, sliding_window, num_seqs, num_heads,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq_idx)  # index of this block in the sequence
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_local = q_block * BLOCK_Q + rows // GROUP  # query token index within the sequence
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head of each row
    row_valid = (rows // GROUP < BLOCK_Q) & (q_local < q_len)
    q_pos = context_len + q_local  # [BLOCK_M] position of each row's token
    tokens = (q_start + q_local).to(tl.int64)  # [BLOCK_M] row in the flattened batch
    dims = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    dim_valid = dims < HEAD_SIZE
    q = tl.load(query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    first_q_pos = context_len + q_block * BLOCK_Q
    kv_end = tl.minimum(first_q_pos + BLOCK_Q, seq_len)  # one past the last visible position
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_q_pos - sliding_window + 1, 0)
    tile_begin = kv_begin // TILE
    tile_end = tl.cdiv(kv_end, TILE)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tile_end - tile_begin, NUM_SPLITS)
        tile_begin = tile_begin + split * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, tile_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of 2^(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64)
    for tile in range(tile_begin, tile_end):
        kv_pos = tile * TILE + tl.arange(0, TILE)  # [TILE]
        kv_valid = kv_pos < kv_end
        block_ids = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)  # [TILE]
        slots = (kv_pos % BLOCK_SIZE).to(tl.int64)  # [TILE]
        k_off = block_ids[None, :] * stride_kb + slots[None, :] * stride_ks + kv_head_off * stride_kh
        k = tl.load(key_cache_ptr + k_off + dims[:, None] * stride_kd,
                    mask=dim_valid[:, None] & kv_valid[None, :], other=0.0)  # [HEAD_PAD, TILE]
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))  # [BLOCK_M, TILE] fp32
        s = s * scale_log2
        allowed = kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])  # [BLOCK_M, TILE]
        if USE_WINDOW:
            allowed = allowed & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE]
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = block_ids[:, None] * stride_vb + slots[:, None] * stride_vs + kv_head_off * stride_vh
        v = tl.load(value_cache_ptr + v_off + dims[None, :] * stride_vd,
                    mask=kv_valid[:, None] & dim_valid[None, :], other=0.0)  # [TILE, HEAD_PAD]
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))  # [BLOCK_M, HEAD_PAD] fp32
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    acc = acc * v_scale
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS > 1:
        part_rows = (tokens * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(part_max_ptr + part_rows, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_rows, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part_rows[:, None] * HEAD_PAD + dims[None, :], acc, mask=store_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads, stride_ot, stride_oh, stride_od,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    split_valid = splits < NUM_SPLITS
    part_rows = (token * num_heads + head) * NUM_SPLITS + splits  # [SPLITS_PAD] int64
    m = tl.load(part_max_ptr + part_rows, mask=split_valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + part_rows, mask=split_valid, other=0.0)
    m_max = tl.max(m, axis=0)
    weights = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [SPLITS_PAD], empty splits -> 0
    total = tl.sum(weights * l, axis=0)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE
    acc = tl.load(part_acc_ptr + part_rows[:, None] * HEAD_PAD + dims[None, :],
                  mask=split_valid[:, None] & dim_valid[None, :], other=0.0)  # [SPLITS_PAD, HEAD_PAD]
    out = tl.sum(acc * weights[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)  # [HEAD_PAD]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"expected query [tokens, heads, head_size] and two equal caches "
                         f"[blocks, block_size, kv_heads, head_size], got {tuple(query.shape)}, "
                         f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if query.shape[2] != key_cache.shape[3] or query.shape[1] % key_cache.shape[2] != 0:
        raise ValueError(f"query heads {query.shape[1]} x {query.shape[2]} do not fit KV heads "
                         f"{key_cache.shape[2]} x {key_cache.shape[3]}")
    if query.shape[2] < 16:
        raise ValueError(f"head size {query.shape[2]} is below 16, the smallest tl.dot operand")
    if key_cache.dtype != value_cache.dtype or not key_cache.dtype.is_floating_point:
        raise TypeError(f"key and value caches must share one float dtype, got {key_cache.dtype}, "
                        f"{value_cache.dtype}")
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens),
                         ("query_start_loc", query_start_loc)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError("need one block table row and seq_len per sequence and num_seqs + 1 query starts")
    if query.device.type != "cuda" and not IS_INTERPRETED:
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "pagedserve.kernels.attention.triton_kernel is imported")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_kv_splits(num_programs: int, max_context: int, device: torch.device) -> int:
    """Splits of the KV range so that about two programs run per SM; 1 when the grid is full."""
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    by_length = triton.cdiv(max_context, TILE_N) // MIN_TILES_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_KV_SPLITS))


def paged_attention(
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
    *,
    num_kv_splits: int | None = None,  # None: chosen from the grid size and the device
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [num_tokens, nh, hs]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    is_decode_only = num_tokens <= num_seqs
    block_m = max(16 if is_decode_only else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    num_q_blocks = num_tokens // block_q + num_seqs  # upper bound, see the module docstring
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_q_blocks * num_kv_heads, block_tables.shape[1] * block_size,
                                             query.device)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    head_pad = triton.next_power_of_2(head_size)
    if num_kv_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_kv_splits, head_pad, dtype=torch.float32,
                               device=query.device)  # [num_tokens, nh, splits, head_pad]
        part_max = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32,
                               device=query.device)  # [num_tokens, nh, splits]
        part_sum = torch.empty_like(part_max)  # [num_tokens, nh, splits]
    else:
        part_acc = part_max = part_sum = out  # not read: the kernel writes `out` directly
    is_dot_fp32 = query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and IS_INTERPRETED)
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_kv_splits)](
        out, part_acc, part_max, part_sum,
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * k_scale * LOG2_E, v_scale, sliding_window or 0, num_seqs, num_heads,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_Q=block_q, TILE=TILE_N, NUM_SPLITS=num_kv_splits, USE_WINDOW=bool(sliding_window),
        DOT_FP32=is_dot_fp32,
    )
    if num_kv_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, num_heads, *out.stride(),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
        )
    return out
