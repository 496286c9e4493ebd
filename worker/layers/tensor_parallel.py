"""Tensor-parallel group and the arithmetic of splitting a dimension across ranks.

A `TensorParallelGroup` is passed explicitly to every parallel layer. With world_size 1 it never
touches torch.distributed, so a single-device worker has no distributed dependency; with
world_size > 1 the caller (the worker process) must have initialised the default process group
(NCCL on GPU, gloo on CPU) before building the model.

Splitting KV heads (GQA) when there are fewer KV heads than ranks: each KV head is replicated on
world_size / num_kv_heads consecutive ranks, which are exactly the ranks whose query heads use it:

    num_heads 8, num_kv_heads 2, world_size 4
    rank        0      1      2      3
    q heads    0-1    2-3    4-5    6-7
    kv head     0      0      1      1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class TensorParallelError(ValueError):
    pass


class CollectiveError(RuntimeError):
    """A collective over the tensor-parallel group failed: a peer rank died, or stalled past the
    process group's timeout. The group cannot be used again; the rank must stop."""


@dataclass(frozen=True, slots=True)
class ShardRange:
    """This rank's slice [start, start + size) of a dimension whose full size is `full_size`."""

    full_size: int
    start: int
    size: int

    def __post_init__(self) -> None:
        if self.size <= 0 or self.start < 0 or self.start + self.size > self.full_size:
            raise TensorParallelError(f"invalid shard [{self.start}, {self.start + self.size}) of {self.full_size}")


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup; None = the default group

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise TensorParallelError(f"world_size must be >= 1, not {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise TensorParallelError(f"rank {self.rank} is outside [0, {self.world_size})")
        if self.world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise TensorParallelError(
                    f"world_size {self.world_size} needs torch.distributed initialised before the model is built"
                )

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over ranks, in place; identity with one rank."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as exc:  # gloo: peer closed or timed out; NCCL: communicator aborted
            raise CollectiveError(f"all-reduce across {self.world_size} ranks failed: {exc}") from exc
        return x

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenation of every rank's x along dim on rank 0; None on the other ranks."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        try:
            dist.gather(x, parts, dst=0, group=self.group)
        except RuntimeError as exc:
            raise CollectiveError(f"gather to rank 0 across {self.world_size} ranks failed: {exc}") from exc
        return torch.cat(parts, dim=dim) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (the others pass a tensor of the same shape and dtype
        to fill); identity with one rank."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        try:
            dist.broadcast(x, src=0, group=self.group)
        except RuntimeError as exc:
            raise CollectiveError(f"broadcast from rank 0 across {self.world_size} ranks failed: {exc}") from exc
        return x

    def even_shard(self, full_size: int, what: str) -> ShardRange:
        """Splits full_size into world_size equal parts; raises when it does not divide."""
        if full_size % self.world_size:
            raise TensorParallelError(f"{what} ({full_size}) is not divisible by world_size {self.world_size}")
        size = full_size // self.world_size
        return ShardRange(full_size, self.rank * size, size)

    def padded_shard(self, full_size: int) -> tuple[int, ShardRange | None]:
        """Rows per rank after padding full_size up to a multiple of world_size, and this rank's real rows.

        The real rows may be fewer than the padded count (or none) on the last ranks.
        """
        per_rank = -(-full_size // self.world_size)
        start = self.rank * per_rank
        size = min(per_rank, full_size - start)
        return per_rank, (ShardRange(full_size, start, size) if size > 0 else None)

    def kv_head_shard(self, num_kv_heads: int, num_heads: int) -> ShardRange:
        """This rank's KV heads: an even split, or one replicated head when num_kv_heads < world_size."""
        if num_heads % self.world_size:
            raise TensorParallelError(f"num_heads ({num_heads}) is not divisible by world_size {self.world_size}")
        if num_kv_heads >= self.world_size:
            return self.even_shard(num_kv_heads, "num_kv_heads")
        if self.world_size % num_kv_heads:
            raise TensorParallelError(
                f"world_size {self.world_size} is not a multiple of num_kv_heads ({num_kv_heads})"
            )
        return ShardRange(num_kv_heads, self.rank * num_kv_heads // self.world_size, 1)
