"""A CPU attention call's rows through the native kernels, straight from the paged cache with no
gathered copy of a context and no padding mask; reference paged_attention_ref.

    rows = plan_native_rows(block_tables, seq_lens, query_start_loc)   # once per step
    paged_decode_attention(lib, query, key_cache, value_cache, out, rows, scale, window, v_scale)
    paged_prefill_attention(lib, query, key_cache, value_cache, out, rows, scale, window, v_scale)

decodes   kernels/native/decode_attention.c, every row of one query position. `supports` says
          whether a call qualifies: CPU tensors, query float32 or bfloat16, caches in the query's
          dtype or float32 (fp8 caches keep the SDPA path), at most 64 query heads per KV head and
          a head size of at most 512, and the native library built.
prefills  kernels/native/prefill_attention.c, the sequences of more query positions (causal over
          any cached prefix): where `supports` holds, the query and caches are bfloat16, the head
          size a multiple of 32 up to 256, and the CPU has AVX-512 BF16 (`supports_prefill`); else
          torch's SDPA (attention/sdpa.py attend_prefills).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.native import library as native_lib
from pagedserve.kernels.native.abi import DTYPE_CODES

MAX_GROUP, MAX_GROUP_WIDTH, MAX_HEAD_SIZE = 64, 8192, 512  # decode_attention.c's stack buffers
MAX_PREFILL_HEAD_SIZE = 256  # prefill_attention.c's MAX_HEAD_SIZE


@dataclass(frozen=True, slots=True)
class NativeRows:
    """The step's decode and prefill sequences and the int32 copies of the step tensors the kernels read."""

    seqs: torch.Tensor  # [D] int64: indexes of the sequences with one query row
    prefills: torch.Tensor  # [P] int64: indexes of the sequences with more
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 contiguous
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32

    @property
    def num_seqs(self) -> int:
        return self.seqs.shape[0]


def plan_native_rows(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> NativeRows:
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    return NativeRows((query_lens == 1).nonzero().flatten(), (query_lens > 1).nonzero().flatten(),
                      block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
                      query_start_loc.to(torch.int32).contiguous())


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
                           out: torch.Tensor, decodes: NativeRows, scale: float, sliding_window: int | None,
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


def supports_prefill(lib, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether paged_prefill_attention takes a call that `supports` took (module doc)."""
    head_size = query.shape[2]
    return (query.dtype == key_cache.dtype == torch.bfloat16 and head_size % 32 == 0
            and head_size <= MAX_PREFILL_HEAD_SIZE and native_lib.has_kernel(lib, "prefill_attention"))


def paged_prefill_attention(lib, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            out: torch.Tensor, rows: NativeRows, scale: float, sliding_window: int | None,
                            v_scale: float) -> bool:
    """Writes the prefill rows of out [T, nh, hs] (contiguous) where supports_prefill holds; False,
    having written nothing, where the kernel could not take them (its scratch not allocated)."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    num_heads = query.shape[1]
    return bool(lib.paged_prefill_attention(
        query.data_ptr(), query.stride(0), out.data_ptr(), num_heads * head_size, key_cache.data_ptr(),
        value_cache.data_ptr(), rows.block_tables.data_ptr(), rows.block_tables.shape[1], rows.seq_lens.data_ptr(),
        rows.query_start_loc.data_ptr(), rows.prefills.data_ptr(), rows.prefills.shape[0], num_heads, num_kv_heads,
        head_size, block_size, scale, sliding_window or 0, v_scale))
