"""Triton KV-cache writes and block copies; block swaps between devices as torch copies.

Cache layout, as in the reference (cache/reference.py): per layer one key and one value tensor
[num_blocks, block_size, num_kv_heads, head_size]; slot s = block_id * block_size + offset.

    write_kv_cache   one program per new token: slot -> (block, offset), all KV heads at once;
                     slot -1 (padding) returns without touching the cache. An fp8 cache gets
                     x / scale saturated to the format's range, rounded to nearest even.
    copy_blocks      one launch for every layer: a device table of cache base addresses
                     (2 per layer: key, value) is indexed by program id, and each program copies
                     one chunk of one (src -> dst) block pair:
                         grid = (num_pairs, 2 * num_layers, chunks per block)
    swap_blocks      GPU <-> CPU swap is a DMA, not a kernel: a Triton program cannot read host
                     memory. Contiguous runs of (src, dst) block ids are merged and each run is
                     one `copy_(non_blocking=True)` from or into (pinned) host memory, queued on
                     the current CUDA stream. Within one device it is a single indexed copy.

copy_blocks expects the src and dst block sets to be disjoint (copy-on-write copies shared
blocks into fresh ones); all programs run concurrently, so a block that is both a source and a
destination would be read in an unspecified state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.cache.kv_dtype import fp8_max, is_fp8

IS_INTERPRETED = bool(triton.knobs.runtime.interpret)  # decided when the decorators below run
COPY_CHUNK = 1024  # elements per copy_blocks program
BITS_BY_SIZE = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}  # copies move raw bits


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    k_inv_scale, v_inv_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,  # 0: not an fp8 cache
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    dims = tl.arange(0, HEAD_PAD)[None, :]  # [1, HEAD_PAD]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)  # [HEADS_PAD, HEAD_PAD]
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    if FP8_MAX > 0:
        key = tl.minimum(tl.maximum(key.to(tl.float32) * k_inv_scale, -FP8_MAX), FP8_MAX)
        key = key.to(key_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        value = tl.minimum(tl.maximum(value.to(tl.float32) * v_inv_scale, -FP8_MAX), FP8_MAX)
        value = value.to(value_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims * stride_kcd,
             key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims * stride_vcd,
             value.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(cache_addrs_ptr, block_mapping_ptr, block_numel, DTYPE: tl.constexpr,
                        CHUNK: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    cache = tl.load(cache_addrs_ptr + tl.program_id(1)).to(tl.pointer_type(DTYPE))
    src = tl.load(block_mapping_ptr + 2 * pair)  # int64
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    offsets = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    mask = offsets < block_numel
    data = tl.load(cache + src * block_numel + offsets, mask=mask)
    tl.store(cache + dst * block_numel + offsets, data, mask=mask)


def _check_launchable(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cuda" and not IS_INTERPRETED:
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "pagedserve.kernels.cache.triton_kernel is imported")


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
    k_scale: float = 1.0,  # fp8 caches store key / k_scale
    v_scale: float = 1.0,
) -> None:
    if key.shape != value.shape or key.dim() != 3 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} and caches "
                         f"{tuple(key_cache.shape)}/{tuple(value_cache.shape)} do not match")
    if key.shape[1:] != key_cache.shape[2:] or slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"key {tuple(key.shape)}, slot_mapping {tuple(slot_mapping.shape)} do not fit "
                         f"cache {tuple(key_cache.shape)}")
    _check_launchable(key_cache)
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(), 1.0 / k_scale, 1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=key_cache.shape[1],
        FP8_MAX=fp8_max(key_cache.dtype) if is_fp8(key_cache.dtype) else 0.0,
    )


def copy_blocks(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_size]
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src, dst) on the caches' device
) -> None:
    if block_mapping.numel() == 0 or not key_caches:
        return
    caches = [*key_caches, *value_caches]
    first = caches[0]
    if len(key_caches) != len(value_caches) or any(
            c.shape != first.shape or c.dtype != first.dtype or c.device != first.device for c in caches):
        raise ValueError("copy_blocks needs one key and one value cache per layer, all of one shape, "
                         "dtype and device")
    if not all(c.is_contiguous() for c in caches):
        raise ValueError("copy_blocks addresses blocks as base + block_id * block_numel: caches must be "
                         "contiguous")
    if first.element_size() not in BITS_BY_SIZE:
        raise TypeError(f"copy_blocks cannot copy {first.dtype}")
    _check_launchable(first)
    cache_addrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64,
                               device=first.device)  # [2 * num_layers]
    mapping = block_mapping.to(device=first.device, dtype=torch.int64).contiguous()  # [num_pairs, 2]
    block_numel = first[0].numel()
    grid = (mapping.shape[0], len(caches), triton.cdiv(block_numel, COPY_CHUNK))
    _copy_blocks_kernel[grid](cache_addrs, mapping, block_numel, DTYPE=BITS_BY_SIZE[first.element_size()],
                              CHUNK=COPY_CHUNK)


def _contiguous_runs(block_mapping: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) for maximal runs where src and dst both advance by one."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in block_mapping.tolist():
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def copy_block_runs(
    src_cache: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_size]
    dst_cache: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_size]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src block, dst block), on the CPU
) -> None:
    """One asynchronous copy per run of consecutive blocks; stays async when host memory is pinned."""
    for src_start, dst_start, length in _contiguous_runs(block_mapping):
        dst_cache[dst_start:dst_start + length].copy_(src_cache[src_start:src_start + length], non_blocking=True)


def swap_blocks(
    src_cache: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_size]
    dst_cache: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_size]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src block, dst block), on the CPU
) -> None:
    """Moves whole blocks between devices (GPU <-> pinned CPU swap) or within one."""
    if block_mapping.numel() == 0:
        return
    if src_cache.shape[1:] != dst_cache.shape[1:] or src_cache.dtype != dst_cache.dtype:
        raise ValueError(f"caches {tuple(src_cache.shape)} {src_cache.dtype} and {tuple(dst_cache.shape)} "
                         f"{dst_cache.dtype} hold different blocks")
    if src_cache.device == dst_cache.device:
        src = block_mapping[:, 0].to(src_cache.device)  # [num_pairs]
        dst = block_mapping[:, 1].to(dst_cache.device)  # [num_pairs]
        dst_cache[dst] = src_cache[src]
    else:
        copy_block_runs(src_cache, dst_cache, block_mapping)
