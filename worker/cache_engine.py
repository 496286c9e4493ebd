"""KV-cache tensors of one rank (device pool + host swap space), their block operations and sizing.

Per layer, keys and values each live in one tensor [num_blocks, block_size, num_kv_heads, head_size]
(num_kv_heads is this rank's share). Block ids index dimension 0, identical on every rank.
A step's block operations run in this order before its forward, so that a block freed by a
swap-out can be reused by a swap-in or a copy of the same step:

    1. swap out   device block -> host block
    2. swap in    host block   -> device block
    3. copy       device block -> device block   (copy-on-write)

With a draft model (draft-model speculation) every block has a second part: the draft model's
K and V in tensors of its own geometry (`draft_shape`: its layers and KV heads), with the same
number of blocks and the same block size, addressed by the same block ids. A block's bytes are
the pair's (`pair_bytes_per_block`), so the pool sizes below count both, and every swap and copy
moves the draft part with the target part.

The tensors hold the KV cache dtype (pagedserve.kernels.cache.kv_dtype): the model's dtype, or a
narrower one (fp8 stores one byte per value), so the same memory holds proportionally more
blocks. Swaps and copies move raw bytes whatever the dtype.

Capacity: on CUDA the device pool takes what is left of
gpu_memory_utilization x total memory after the weights and the peak activations of a profiling
forward; on CPU it takes 10 % of the host's total memory after the weights, at least 256 MiB and
at most 2 GiB, split between the ranks (pagedserve.host_memory, which says why), so a shared host
keeps room for other processes and the size is the same on every start. Swap space (and an
explicit KV budget) is converted to blocks by `blocks_for_bytes`.

Memory: a CPU pool's tensors lie on an anonymous mapping, which the kernel hands out as zero
pages and backs with memory at a page's first write (`zeroed_host_tensor`). A pool of any size
costs nothing at its allocation, where zeroing it with the CPU (`torch.zeros`) touched every page
before the worker could serve, and it takes memory only for the blocks ever written. It reads as
zeros everywhere, as `torch.zeros` did, so a kernel that reads a whole block sees no garbage in
its unused slots.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from pagedserve.host_memory import cpu_kv_pool_bytes, total_memory
from pagedserve.kernels import ops

GIB = 1 << 30

KVCache = tuple[torch.Tensor, torch.Tensor]


class CacheConfigError(ValueError):
    pass


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on a private anonymous mapping of its own: the kernel maps each page
    as zeros and gives it memory at its first write, so nothing is touched here. The tensor keeps
    the mapping alive; the mapping goes when the tensor does."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


@dataclass(frozen=True, slots=True)
class CacheShape:
    """One rank's KV geometry."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # on this rank
    head_size: int
    dtype: torch.dtype  # the KV cache's storage dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise CacheConfigError(f"{name} must be positive, not {getattr(self, name)}")

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * element_size


def pair_bytes_per_block(shape: CacheShape, draft: CacheShape | None = None) -> int:
    """Bytes of one block: the target's K and V over all its layers, plus the draft model's."""
    return shape.bytes_per_block + (draft.bytes_per_block if draft is not None else 0)


def blocks_for_bytes(num_bytes: int, shape: CacheShape, draft: CacheShape | None = None) -> int:
    """Whole blocks (with their draft part, if any) fitting in num_bytes (swap space, an explicit KV budget)."""
    if num_bytes < 0:
        raise CacheConfigError(f"a memory budget must be >= 0 bytes, not {num_bytes}")
    return num_bytes // pair_bytes_per_block(shape, draft)


def cpu_device_blocks(shape: CacheShape, num_weight_bytes: int, num_ranks: int = 1,
                      total_bytes: int | None = None, draft: CacheShape | None = None) -> int:
    """Device pool size in blocks when the device is the CPU, for a rank holding num_weight_bytes
    of weights (the draft model's included) in a replica of num_ranks:
    pagedserve.host_memory.cpu_kv_pool_bytes."""
    total = total_memory() if total_bytes is None else total_bytes
    return cpu_kv_pool_bytes(total, num_weight_bytes * num_ranks, num_ranks) // pair_bytes_per_block(shape, draft)


def cuda_device_blocks(shape: CacheShape, device: torch.device, gpu_memory_utilization: float,
                       draft: CacheShape | None = None) -> int:
    """Device pool size on CUDA, to be called right after a profiling forward.

    The caching allocator still holds the profiling run's activations, so total - free is the
    process's peak footprint (weights + activations + other users of the GPU).
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise CacheConfigError(f"gpu_memory_utilization must be in (0, 1], not {gpu_memory_utilization}")
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = max(total - free, torch.cuda.max_memory_reserved(device))
    budget = int(total * gpu_memory_utilization) - peak
    return max(budget, 0) // pair_bytes_per_block(shape, draft)


class CacheEngine:
    """Allocates the device pool and the host swap space and runs a step's block operations.

    draft_shape: the draft model's geometry; its caches (draft_gpu_cache, draft_cpu_cache: empty
    lists without a draft model) have the same block counts and follow every block operation.
    """

    def __init__(self, shape: CacheShape, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device,
                 draft_shape: CacheShape | None = None) -> None:
        if num_gpu_blocks <= 0:
            raise CacheConfigError(f"num_gpu_blocks must be positive, not {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise CacheConfigError(f"num_cpu_blocks must be >= 0, not {num_cpu_blocks}")
        if draft_shape is not None and draft_shape.block_size != shape.block_size:
            raise CacheConfigError(f"the draft cache's block size {draft_shape.block_size} differs from "
                                   f"the target's {shape.block_size}")
        self.shape = shape
        self.device = torch.device(device)
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.gpu_cache: list[KVCache] = self._allocate(num_gpu_blocks, self.device, pin=False)
        pin = self.device.type == "cuda"
        self.cpu_cache: list[KVCache] = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=pin)
        self.draft_shape = draft_shape
        self.draft_gpu_cache: list[KVCache] = []
        self.draft_cpu_cache: list[KVCache] = []
        if draft_shape is not None:
            self.draft_gpu_cache = self._allocate(num_gpu_blocks, self.device, pin=False, shape=draft_shape)
            self.draft_cpu_cache = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=pin, shape=draft_shape)

    @property
    def bytes_per_block(self) -> int:
        """A block's bytes over all layers, the draft part included."""
        return pair_bytes_per_block(self.shape, self.draft_shape)

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool,
                  shape: CacheShape | None = None) -> list[KVCache]:
        shape = shape or self.shape
        block_shape = shape.block_shape(num_blocks)
        caches = []
        for _ in range(shape.num_layers):
            if device.type == "cpu" and not pin:
                key = zeroed_host_tensor(block_shape, shape.dtype)  # [nb, bs, kvh, hs]
                value = zeroed_host_tensor(block_shape, shape.dtype)
            else:
                key = torch.zeros(block_shape, dtype=shape.dtype, device=device, pin_memory=pin)  # [nb, bs, kvh, hs]
                value = torch.zeros(block_shape, dtype=shape.dtype, device=device, pin_memory=pin)
            caches.append((key, value))
        return caches

    @staticmethod
    def _mapping(pairs: list[tuple[int, int]], device: torch.device) -> torch.Tensor:  # [num_pairs, 2] int64
        return torch.tensor(pairs, dtype=torch.int64, device=device).reshape(-1, 2)

    def _check(self, ids, limit: int, what: str) -> None:
        bad = [block_id for block_id in ids if not 0 <= block_id < limit]
        if bad:
            raise CacheConfigError(f"{what} block ids {bad[:8]} are outside [0, {limit})")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        if not pairs:
            return
        self._check((src for src, _ in pairs), self.num_gpu_blocks, "swap-out source")
        self._check((dst for _, dst in pairs), self.num_cpu_blocks, "swap-out destination")
        self._swap(self.gpu_cache, self.cpu_cache, pairs)
        self._swap(self.draft_gpu_cache, self.draft_cpu_cache, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        if not pairs:
            return
        self._check((src for src, _ in pairs), self.num_cpu_blocks, "swap-in source")
        self._check((dst for _, dst in pairs), self.num_gpu_blocks, "swap-in destination")
        self._swap(self.cpu_cache, self.gpu_cache, pairs)
        self._swap(self.draft_cpu_cache, self.draft_gpu_cache, pairs)

    def _swap(self, src: list[KVCache], dst: list[KVCache], pairs: list[tuple[int, int]]) -> None:
        mapping = self._mapping(pairs, torch.device("cpu"))
        for (src_key, src_value), (dst_key, dst_value) in zip(src, dst):
            ops.swap_blocks(src_key, dst_key, mapping)
            ops.swap_blocks(src_value, dst_value, mapping)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(source device block, destination device block) pairs."""
        if not pairs:
            return
        self._check((block for pair in pairs for block in pair), self.num_gpu_blocks, "copy")
        mapping = self._mapping(pairs, self.device)
        for caches in (self.gpu_cache, self.draft_gpu_cache):  # one call per geometry
            if caches:
                ops.copy_blocks([key for key, _ in caches], [value for _, value in caches], mapping)

    def execute_block_ops(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                          copy: list[tuple[int, int]]) -> None:
        self.swap_out(swap_out)
        self.swap_in(swap_in)
        self.copy(copy)
