"""Rows of a GGUF tensor kept as ggml stores them, and their int4/int8 group form.

A GGUF weight [out, in] is stored row by row; each row is a run of blocks, each block coding
`block_size` consecutive values of the row (32 for the legacy quants, 256 for K-quants, 1 for
F32/F16/BF16). The blocks this module unpacks (ggml's block_q4_0, block_q4_1, block_q8_0):

    Q4_0  | d f16 | qs[16] |                 w = (q - 8) * d
    Q4_1  | d f16 | m f16 | qs[16] |         w = q * d + m
    Q8_0  | d f16 | qs[32] int8 |            w = q * d

    qs[16]: byte j holds value j in its low nibble and value j + 16 in its high nibble.

`GGUFBlocks` holds some rows (and block-aligned columns) of one tensor without decoding them, so
the loader can hand a rank only its slice. `to_int4_groups` / `to_int8_groups` turn legacy
blocks into one value per element plus per-group (32) scales and mins, the layout of our
quantized linear layers; their `dequantize()` equals gguf.quants.dequantize bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
_INT4_TYPES = ("Q4_0", "Q4_1")


class GGUFBlocksError(ValueError):
    pass


@dataclass(frozen=True, eq=False)
class GGUFBlocks:
    """Rows [out, in] of a GGUF tensor, undecoded: data is uint8 [rows, in / block_size * type_size]."""

    tensor_type: str  # GGML type name: Q4_0, Q8_0, F16, ...
    shape: tuple[int, int]  # (rows, columns) in elements
    data: np.ndarray  # any dtype on input (F16 rows may come as float16): kept as its bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", np.asarray(self.data).view(np.uint8).reshape(self.shape[0], -1))

    @classmethod
    def of_tensor(cls, tensor) -> "GGUFBlocks":
        """A whole gguf ReaderTensor (memory-mapped, nothing read yet); 1-D tensors become one column."""
        from gguf import GGML_QUANT_SIZES

        block_size = GGML_QUANT_SIZES[tensor.tensor_type][0]
        dims = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dim first
        if len(dims) == 1:
            if block_size != 1:
                raise GGUFBlocksError(f"1-D tensor {tensor.name} is {tensor.tensor_type.name}: only float 1-D "
                                      f"tensors are supported")
            return cls(tensor.tensor_type.name, (dims[0], 1), tensor.data)
        if len(dims) != 2:
            raise GGUFBlocksError(f"tensor {tensor.name} has {len(dims)} dimensions, not 1 or 2")
        return cls(tensor.tensor_type.name, dims, tensor.data)

    def _sizes(self) -> tuple[int, int]:  # (values per block, bytes per block)
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return GGML_QUANT_SIZES[GGMLQuantizationType[self.tensor_type]]

    def rows(self, start: int, length: int) -> "GGUFBlocks":
        return GGUFBlocks(self.tensor_type, (length, self.shape[1]), self.data[start:start + length])

    def take_rows(self, order: np.ndarray) -> "GGUFBlocks":
        """The rows in `order` (a permutation or selection of row indices)."""
        return GGUFBlocks(self.tensor_type, (len(order), self.shape[1]), self.data[order])

    def columns(self, start: int, length: int) -> "GGUFBlocks":
        """Columns [start, start + length): cut between blocks when both ends fall on block borders,
        else decoded (the result is then F32)."""
        block_size, type_size = self._sizes()
        if start % block_size == 0 and length % block_size == 0:
            first, num = start // block_size * type_size, length // block_size * type_size
            return GGUFBlocks(self.tensor_type, (self.shape[0], length), self.data[:, first:first + num])
        values = np.ascontiguousarray(self.dequantize()[:, start:start + length])  # float32 [rows, length]
        return GGUFBlocks("F32", (self.shape[0], length), values.view(np.uint8))

    def dequantize(self) -> np.ndarray:
        """float32 [rows, columns], decoded by gguf.quants.dequantize."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(np.ascontiguousarray(self.data), GGMLQuantizationType[self.tensor_type])
        return values if values.flags.writeable else values.copy()  # F32 comes back as a file view

    @property
    def num_bytes(self) -> int:
        return int(self.data.size)


@dataclass(frozen=True, eq=False)
class Int4Groups:
    """weight = values * scale + min, one scale and min per group of 32 consecutive columns."""

    values: torch.Tensor  # uint8 [rows, cols], 0..15
    scales: torch.Tensor  # float32 [rows, cols / 32]
    mins: torch.Tensor  # float32 [rows, cols / 32]; Q4_0 has min = -8 * scale
    group_size: int = GROUP_SIZE

    def dequantize(self) -> torch.Tensor:  # float32 [rows, cols]
        scales = self.scales.repeat_interleave(self.group_size, dim=1)  # [rows, cols]
        mins = self.mins.repeat_interleave(self.group_size, dim=1)  # [rows, cols]
        return self.values.float() * scales + mins


@dataclass(frozen=True, eq=False)
class Int8Groups:
    """weight = values * scale, one scale per group of 32 consecutive columns."""

    values: torch.Tensor  # int8 [rows, cols]
    scales: torch.Tensor  # float32 [rows, cols / 32]
    group_size: int = GROUP_SIZE

    def dequantize(self) -> torch.Tensor:  # float32 [rows, cols]
        return self.values.float() * self.scales.repeat_interleave(self.group_size, dim=1)


def _blocks_of(blocks: GGUFBlocks, type_size: int) -> np.ndarray:  # uint8 [rows, cols / 32, type_size]
    rows, cols = blocks.shape
    return np.ascontiguousarray(blocks.data).reshape(rows, cols // GROUP_SIZE, type_size)


def _f16(raw: np.ndarray) -> torch.Tensor:  # uint8 [..., 2] -> float32 [...]
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def to_int4_groups(blocks: GGUFBlocks) -> Int4Groups:
    """Q4_0 or Q4_1 blocks -> unpacked 4-bit values with per-group scale and min."""
    if blocks.tensor_type not in _INT4_TYPES:
        raise GGUFBlocksError(f"int4 groups come from Q4_0 or Q4_1 blocks, not {blocks.tensor_type}")
    has_min = blocks.tensor_type == "Q4_1"
    header = 4 if has_min else 2
    raw = _blocks_of(blocks, header + GROUP_SIZE // 2)  # [rows, groups, type_size]
    scales = _f16(raw[..., 0:2])  # [rows, groups]
    mins = _f16(raw[..., 2:4]) if has_min else -8.0 * scales  # [rows, groups]
    packed = raw[..., header:]  # [rows, groups, 16]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [rows, groups, 32]: low nibbles first
    values = torch.from_numpy(values.reshape(blocks.shape))  # [rows, cols]
    return Int4Groups(values=values, scales=scales, mins=mins)


def to_int8_groups(blocks: GGUFBlocks) -> Int8Groups:
    """Q8_0 blocks -> int8 values with a per-group scale."""
    if blocks.tensor_type != "Q8_0":
        raise GGUFBlocksError(f"int8 groups come from Q8_0 blocks, not {blocks.tensor_type}")
    raw = _blocks_of(blocks, 2 + GROUP_SIZE)  # [rows, groups, 34]
    values = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(blocks.shape)  # [rows, cols]
    return Int8Groups(values=torch.from_numpy(values), scales=_f16(raw[..., 0:2]))
