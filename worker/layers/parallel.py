"""Megatron-style tensor-parallel layers and where their weights come from in a checkpoint.

    ColumnParallelLinear   y_local = x @ W[rows of this rank]^T      (QKV, gate/up; no communication)
    RowParallelLinear      y = all_reduce(x_local @ W[:, cols of this rank]^T) + bias   (o, down)
    VocabParallelEmbedding each rank embeds the ids in its vocab range, zeros elsewhere, all-reduce
    ParallelLMHead         each rank scores its vocab range; logits gathered on rank 0

Every layer describes its parameters' origin as `TensorSlice`s (checkpoint tensor, dimension,
range), so the loader reads only this rank's slices and can report missing or misshapen tensors.
A column-parallel layer may fuse several checkpoint tensors (q, k, v or gate, up): its local rows
are the concatenation of each one's local slice, in order.

The two linear layers may hold their weight quantized (int8/int4, see
pagedserve.worker.quantization.linear); they load dense and are quantized after the load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels import ops
from pagedserve.worker.quantization.linear import QuantizableLinear
from pagedserve.worker.layers.tensor_parallel import ShardRange, TensorParallelGroup


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """checkpoint[name].narrow(dim, src_start, length) -> our param.narrow(dim, dst_start, length)."""

    checkpoint_name: str
    checkpoint_shape: tuple[int, ...]  # the full tensor's shape in the checkpoint
    param_name: str
    dim: int
    src_start: int
    dst_start: int
    length: int


def whole_tensor(checkpoint_name: str, shape: tuple[int, ...], param_name: str) -> TensorSlice:
    return TensorSlice(checkpoint_name, tuple(shape), param_name, 0, 0, 0, shape[0])


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class ColumnParallelLinear(QuantizableLinear):
    """Output rows split across ranks; `shards` gives, per fused checkpoint tensor, this rank's rows."""

    def __init__(self, input_size: int, shards: list[ShardRange], *, bias: bool, dtype: torch.dtype,
                 device) -> None:
        super().__init__()
        self.input_size = input_size
        self.shards = list(shards)
        self.output_size = sum(shard.size for shard in self.shards)
        self.weight = _empty((self.output_size, input_size), dtype, device)  # [out_local, in]
        self.bias = _empty((self.output_size,), dtype, device) if bias else None  # [out_local]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out_local]
        return self.matmul(x, self.bias)

    def input_range(self) -> tuple[int, int, int]:
        return self.input_size, 0, self.input_size

    def checkpoint_slices(self, param_prefix: str, checkpoint_prefixes: list[str]) -> list[TensorSlice]:
        if len(checkpoint_prefixes) != len(self.shards):
            raise ValueError(f"{param_prefix}: {len(self.shards)} fused tensors, {len(checkpoint_prefixes)} names")
        slices, offset = [], 0
        for prefix, shard in zip(checkpoint_prefixes, self.shards):
            slices.append(TensorSlice(f"{prefix}.weight", (shard.full_size, self.input_size),
                                      f"{param_prefix}.weight", 0, shard.start, offset, shard.size))
            if self.bias is not None:
                slices.append(TensorSlice(f"{prefix}.bias", (shard.full_size,), f"{param_prefix}.bias",
                                          0, shard.start, offset, shard.size))
            offset += shard.size
        return slices


class RowParallelLinear(QuantizableLinear):
    """Input columns split across ranks; partial products summed over ranks, bias added once after."""

    def __init__(self, input_shard: ShardRange, output_size: int, *, bias: bool, tp: TensorParallelGroup,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        self.input_shard = input_shard
        self.output_size = output_size
        self.tp = tp
        self.weight = _empty((output_size, input_shard.size), dtype, device)  # [out, in_local]
        self.bias = _empty((output_size,), dtype, device) if bias else None  # [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_local] -> [T, out]
        if self.tp.world_size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))  # [T, out]
        return y + self.bias if self.bias is not None else y

    def input_range(self) -> tuple[int, int, int]:
        shard = self.input_shard
        return shard.full_size, shard.start, shard.size

    def checkpoint_slices(self, param_prefix: str, checkpoint_prefix: str) -> list[TensorSlice]:
        shard = self.input_shard
        slices = [TensorSlice(f"{checkpoint_prefix}.weight", (self.output_size, shard.full_size),
                              f"{param_prefix}.weight", 1, shard.start, 0, shard.size)]
        if self.bias is not None:
            slices.append(whole_tensor(f"{checkpoint_prefix}.bias", (self.output_size,), f"{param_prefix}.bias"))
        return slices


class VocabParallelEmbedding(torch.nn.Module):
    """Rows [rank * rows_per_rank, (rank + 1) * rows_per_rank) of the (padded) vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TensorParallelGroup, dtype: torch.dtype,
                 device) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp = tp
        self.rows_per_rank, self.shard = tp.padded_shard(vocab_size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = _empty((self.rows_per_rank, hidden_size), dtype, device)  # [rows_per_rank, hidden]
        num_real = self.shard.size if self.shard else 0
        if num_real < self.rows_per_rank:
            self.weight.data[num_real:].zero_()  # padding rows: never looked up, score 0 (trimmed)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.world_size == 1:
            return F.embedding(token_ids, self.weight)
        local_ids = token_ids - self.vocab_start  # [T]
        is_outside = (local_ids < 0) | (local_ids >= self.rows_per_rank)  # [T]
        embedded = F.embedding(local_ids.masked_fill(is_outside, 0), self.weight)  # [T, hidden]
        embedded.masked_fill_(is_outside[:, None], 0)
        return self.tp.all_reduce(embedded)

    def checkpoint_slices(self, param_prefix: str, checkpoint_name: str) -> list[TensorSlice]:
        if self.shard is None:
            return []
        return [TensorSlice(checkpoint_name, (self.vocab_size, self.hidden_size), f"{param_prefix}.weight",
                            0, self.shard.start, 0, self.shard.size)]


class ParallelLMHead(torch.nn.Module):
    """Vocabulary-parallel output projection; `tied_to` shares the embedding's weight (same sharding)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TensorParallelGroup, dtype: torch.dtype,
                 device, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.is_tied = tied_to is not None
        if tied_to is not None:
            self.embedding = tied_to  # shares tied_to.weight; loaded through the embedding
        else:
            self.embedding = VocabParallelEmbedding(vocab_size, hidden_size, tp=tp, dtype=dtype, device=device)

    prepacked_weight: object | None = None  # panels or oneDNN copy (worker/loading/prepacked_weights.py)
    blocks: ops.BlockQuantWeight | None = None  # a GGUF file's blocks of the weight (--quantization auto)

    @property
    def weight(self) -> torch.Tensor:  # [rows_per_rank, hidden]
        return self.embedding.weight

    def set_blocks(self, blocks: ops.BlockQuantWeight) -> None:
        """Keeps the weight's GGUF blocks as the file has them (the same values as the dense weight
        in float32), multiplied instead of the dense weight where the block kernel reads fewer bytes
        at full speed (ops.block_quant_prefers: the few rows of a decode step)."""
        if blocks.out_features != self.weight.shape[0] or blocks.in_features != self.weight.shape[1]:
            raise ValueError(f"blocks of {blocks.out_features}x{blocks.in_features} for an LM head of "
                             f"{tuple(self.weight.shape)}")
        self.blocks = blocks

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [L, hidden] -> logits [L, vocab_size] on rank 0, None on the others."""
        if self.blocks is not None and ops.block_quant_prefers(hidden, self.blocks):
            logits = ops.block_quant_linear(hidden, self.blocks)  # [L, rows_per_rank]
        else:
            logits = ops.linear(hidden, self.weight, prepacked=self.prepacked_weight)  # [L, rows_per_rank]
        logits = self.tp.gather_to_first(logits, dim=-1)  # [L, rows_per_rank * world_size] on rank 0
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size]

    def bound_forward(self, hidden: torch.Tensor):
        """forward(hidden) as (call, logits): call() writes the logits of hidden [L, hidden] (the caller
        keeps it and changes only its values) into logits [L, vocab_size], with the kernel forward
        would take for L rows, picked once (ops.bound_linear, ops.bound_block_quant_linear). None
        where forward takes another path (tensor parallelism, a kernel without such a call): the
        caller then calls it."""
        if self.tp.world_size != 1:
            return None
        logits = torch.empty(hidden.shape[0], self.weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        if self.blocks is not None and ops.block_quant_prefers(hidden, self.blocks):
            call = ops.bound_block_quant_linear(hidden, self.blocks, out=logits)
        else:
            call = ops.bound_linear(hidden, self.weight, prepacked=self.prepacked_weight, out=logits)
        if call is None:
            return None
        return call, logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size]

    def checkpoint_slices(self, param_prefix: str, checkpoint_name: str) -> list[TensorSlice]:
        if self.is_tied:
            return []
        return self.embedding.checkpoint_slices(f"{param_prefix}.embedding", checkpoint_name)
