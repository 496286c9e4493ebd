"""Weight-only quantized linear weights in the form the matmul kernels consume.

    Int8Weight   symmetric, one scale per output row:
                     W[n, k] ~= qweight[n, k] * scales[n]
    Int4Weight   asymmetric, one (scale, zero) per output row and group of `group_size` inputs,
                 in the layout of PyTorch's CPU int4 kernel (tinygemm):
                     W[n, k] ~= (code[n, k] - 8) * scale[g, n] + zero[g, n],   g = k // group_size
                 codes 0..15 packed two per byte (pagedserve.kernels.linear.int4_layout);
                 scales_and_zeros [K_padded / group_size, N, 2] = (scale, zero).

Both keep their scales in bfloat16, the activation dtype of the CPU kernels. An int4 weight
whose input size is not a multiple of the group size is stored zero-padded to whole groups
(`padded_in_features`); activations are padded to match, so the padding contributes nothing.

`dequantize` gives the float weight [N, K] (the plain-torch reference path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.linear.int4_layout import unpack_int4

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts
INT4_ROW_MULTIPLE = 16  # output rows per packed block, at least
SCALE_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Int8Weight:
    qweight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] bfloat16

    def __post_init__(self) -> None:
        if self.qweight.dtype != torch.int8 or self.qweight.dim() != 2:
            raise ValueError(f"int8 qweight must be a 2-D int8 tensor, not {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)}")
        if self.scales.shape != self.qweight.shape[:1]:
            raise ValueError(f"int8 scales {tuple(self.scales.shape)} do not match {self.qweight.shape[0]} rows")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        return (self.qweight.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(dtype)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    packed: torch.Tensor  # [N, padded_in_features / 2] uint8, PyTorch's CPU layout
    scales_and_zeros: torch.Tensor  # [padded_in_features / group_size, N, 2] bfloat16
    group_size: int
    in_features: int  # K before padding

    def __post_init__(self) -> None:
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {self.group_size}")
        num_rows, half_cols = self.packed.shape
        if self.packed.dtype != torch.uint8 or num_rows % INT4_ROW_MULTIPLE:
            raise ValueError(f"int4 packed weight must be uint8 with rows divisible by {INT4_ROW_MULTIPLE}, "
                             f"not {self.packed.dtype} {tuple(self.packed.shape)}")
        padded = 2 * half_cols
        if padded % self.group_size or not padded - self.group_size < self.in_features <= padded:
            raise ValueError(f"int4 weight of {padded} packed columns does not hold {self.in_features} inputs "
                             f"in whole groups of {self.group_size}")
        if self.scales_and_zeros.shape != (padded // self.group_size, num_rows, 2):
            raise ValueError(f"int4 scales_and_zeros {tuple(self.scales_and_zeros.shape)} do not match "
                             f"{padded // self.group_size} groups x {num_rows} rows x 2")

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def padded_in_features(self) -> int:
        return 2 * self.packed.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        num_rows, padded = self.out_features, self.padded_in_features
        codes = unpack_int4(self.packed, num_rows, padded).to(torch.float32)  # [N, K_padded]
        scales_and_zeros = self.scales_and_zeros.to(torch.float32).transpose(0, 1)  # [N, groups, 2]
        scale, zero = scales_and_zeros[..., 0:1], scales_and_zeros[..., 1:2]  # [N, groups, 1] each
        weight = (codes.view(num_rows, -1, self.group_size) - 8.0) * scale + zero  # [N, groups, G]
        return weight.reshape(num_rows, padded)[:, : self.in_features].to(dtype)


PackedWeight = Int8Weight | Int4Weight  # and kernels.linear.block_quant.BlockQuantWeight (GGUF blocks)
