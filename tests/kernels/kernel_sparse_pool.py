"""KV pools whose addresses pass 2^31 elements, without 4 GiB of memory, for int64 address tests.

A pool of 2^20 + n blocks of 16 x 1 x 128 half floats spans 4 GiB: block id * block stride no
longer fits int32. The cache tensor maps a sparse file copy-on-write (torch.from_file, shared=False):

    file (sparse, 4 GiB of holes)   |  zero pages  ...  | written blocks (ids > 2^20) |
    process memory                    only the written blocks' pages

Untouched blocks read as zeros and cost nothing. A mapping cannot be pickled by value, so these
functions run entirely in the interpreter process (tests reach them through `interpreter.call`)
and return small tensors: the Triton result and the reference result for the same inputs.
"""

from __future__ import annotations

import os

import torch

from pagedserve.kernels.cache.triton_kernel import copy_blocks, write_kv_cache
from pagedserve.kernels.cache.reference import copy_blocks_ref, write_kv_cache_ref
from pagedserve.kernels.attention.triton_kernel import paged_attention
from pagedserve.kernels.attention.reference import paged_attention_ref

BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 16, 1, 128
BLOCK_NUMEL = BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE
MIN_BLOCK_ID = 2 ** 31 // BLOCK_NUMEL  # the first block whose offset needs more than int32
NUM_BLOCKS = MIN_BLOCK_ID + 64
DTYPE = torch.float16


def sparse_cache(path: str) -> torch.Tensor:  # [NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE]
    numel = NUM_BLOCKS * BLOCK_NUMEL
    if not os.path.exists(path):
        with open(path, "wb") as file:
            file.truncate(numel * DTYPE.itemsize)
    flat = torch.from_file(path, shared=False, size=numel, dtype=DTYPE)  # [numel], copy-on-write mapping
    return flat.view(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)


def attention(path: str, num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode and a prefill chunk whose blocks all sit above MIN_BLOCK_ID."""
    gen = torch.Generator().manual_seed(7)
    key_cache, value_cache = sparse_cache(path), sparse_cache(path)
    seq_lens = torch.tensor([45, 20], dtype=torch.int32)  # [2]
    block_tables = (MIN_BLOCK_ID + torch.randperm(64, generator=gen)[:8]).view(2, 4).int()  # [2, 4]
    for seq, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len)
        blocks, slots = block_tables[seq, positions // BLOCK_SIZE].long(), positions % BLOCK_SIZE
        key_cache[blocks, slots] = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(DTYPE)
        value_cache[blocks, slots] = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(DTYPE)
    query = torch.randn(1 + 7, 2 * NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(DTYPE)  # [8, 2, 128]
    query_start_loc = torch.tensor([0, 1, 8], dtype=torch.int32)  # [3]
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, HEAD_SIZE ** -0.5)
    return paged_attention(*args, num_kv_splits=num_kv_splits), paged_attention_ref(*args)


def write(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows written by both implementations at slots above 2^31 elements; padding slots skipped."""
    gen = torch.Generator().manual_seed(8)
    key = torch.randn(6, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(DTYPE)  # [6, kvh, hs]
    value = torch.randn(6, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(DTYPE)
    first_slot = (NUM_BLOCKS - 3) * BLOCK_SIZE
    slot_mapping = torch.tensor([first_slot + 5, -1, first_slot + 17, first_slot + 47, -1, first_slot])  # [6]
    results = []
    for write_fn in (write_kv_cache, write_kv_cache_ref):
        key_cache, value_cache = sparse_cache(path), sparse_cache(path)
        write_fn(key, value, key_cache, value_cache, slot_mapping)
        results.append(torch.stack([key_cache[-3:], value_cache[-3:]]))  # [2, 3, bs, kvh, hs]
    return results[0], results[1]


def copy(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two layers, blocks copied from and to ids above MIN_BLOCK_ID."""
    gen = torch.Generator().manual_seed(9)
    mapping = torch.tensor([[NUM_BLOCKS - 1, MIN_BLOCK_ID], [NUM_BLOCKS - 2, NUM_BLOCKS - 5]])  # [2, 2]
    results = []
    for copy_fn in (copy_blocks, copy_blocks_ref):
        gen.manual_seed(9)
        caches = [sparse_cache(path) for _ in range(4)]
        for cache in caches:
            cache[-2:] = torch.randn(2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(DTYPE)
        copy_fn(caches[:2], caches[2:], mapping)
        results.append(torch.stack([cache[mapping[:, 1]] for cache in caches]))  # [4, 2, bs, kvh, hs]
    return results[0], results[1]
