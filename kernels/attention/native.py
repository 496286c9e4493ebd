"""The decodes of a CPU attention call through the native kernel (kernels/native/decode_attention.c):
each decode row attends straight from the paged cache, with no gathered copy of its context and
no padding mask; reference paged_attention_ref. Prefill chunks keep SDPA (paged_attention_sdpa).

    decodes = plan_native_decodes(block_tables, seq_lens, query_start_loc)   # once per step
    paged_decode_attention(query, key_cache, value_cache, out, decodes, scale, window, v_scale)

`supports` says whether a call qualifies: CPU tensors, query float32 or bfloat16, caches in the
query's dtype or float32 (fp8 caches keep the SDPA path), at most 64 query heads per KV head and
a head size of at most 512, and the native library built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.native import library as native_lib
from pagedserve.kernels.native.abi import DTYPE_CODES
MAX_GROUP, MAX_GROUP_WIDTH, MAX_HEAD_SIZE = 64, 8192, 512  # decode_attention.c's stack buffers


@dataclass(frozen=True, slots=True)
class NativeDecodes:
    """The step's decode sequences and the int32 copies of the step tensors the kernel reads."""

    seqs: torch.Tensor  # [D] int64: indexes of the sequences with one query row
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 contiguous
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32

    @property
    def num_seqs(self) -> int:
        return self.seqs.shape[0]


def plan_native_decodes(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor) -> NativeDecodes:
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    return NativeDecodes((query_lens == 1).nonzero().flatten(), block_tables.to(torch.int32).contiguous(),
                         seq_lens.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous())


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor):
    """-> the native library when the call qualifies, else None."""
    num_heads, head_size = query.shape[1], query.shape[2]
    group = num_heads // key_cache.shape[2]
    if not (query.device.type == "cpu" and query.dtype in DTYPE_CODES and query.stride(2) == 1
            and query.stride(1) == head_size and key_cache.dtype in (query.dtype, torch.float32)
            and value_cache.dtype == key_cache.dtype and key_cache.is_contiguous() and value_cache.is_contiguous()
            and group <= MAX_GROUP and group * head_size <= MAX_GROUP_WIDTH and head_size <= MAX_HEAD_SIZE):
        return None
    return native_lib.load()


def paged_decode_attention(lib, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           out: torch.Tensor, decodes: NativeDecodes, scale: float, sliding_window: int | None,
                           v_scale: float) -> None:
    """Writes the decode rows of out [T, nh, hs] (contiguous): softmax(q . k * scale) @ v * v_scale."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    num_heads = query.shape[1]
    lib.paged_decode_attention(query.data_ptr(), query.stride(0), out.data_ptr(), num_heads * head_size,
                               key_cache.data_ptr(), value_cache.data_ptr(), decodes.block_tables.data_ptr(),
                               decodes.block_tables.shape[1], decodes.seq_lens.data_ptr(),
                               decodes.query_start_loc.data_ptr(), decodes.seqs.data_ptr(), decodes.num_seqs,
                               num_heads, num_kv_heads, head_size, block_size, scale, sliding_window or 0, v_scale,
                               DTYPE_CODES[query.dtype], DTYPE_CODES[key_cache.dtype])
