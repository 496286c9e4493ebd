"""Weight-only quantization of linear layers: the options, the quantizers and GGUF's pre-quantized
weights.

    auto   a GGUF's Q4_0/Q4_1/Q8_0 linear weights stay quantized exactly as the file has them
           (codes with float16 scales and minimums per group of 32: kernels/linear/block_quant.py),
           everything else as `none` (pagedserve.worker.loading.gguf_weights)
    none   weights in the model dtype (a GGUF's quantized weights dequantized to it)
    int8   symmetric, one scale per output channel:        W[n, k] ~= q[n, k] * s[n],  q in -128..127
    int4   asymmetric, one (scale, min) per output channel and group of G inputs (default 32,
           chosen by accuracy: docs/quantization-accuracy.md):
               W[n, k] ~= c[n, k] * s[n, g] + m[n, g],   c in 0..15,   g = k // G

Scales and int4 zeros (the value of code 8) are rounded to bfloat16 (the kernels' dtype) before
the codes are chosen, so the codes are the best ones for the scales and zeros actually used (a zero
rounded after the codes were chosen shifts every value of its group). An int4 layer whose input size is not a multiple
of G (SmolLM2: 576 = 4.5 x 128) gets a shorter last group, stored zero-padded to G; the padding
never meets a non-zero activation.

Tensor parallelism quantizes each rank's shard on its own. Output rows are independent, so
column-parallel layers need nothing more; a row-parallel layer splits the input dimension: int8
then takes each row's scale over the rank's own inputs (a finer grid than one rank would use), and
int4 groups must not straddle a shard boundary (each rank's input range must start on a
group boundary and hold whole groups, a short last group of the whole tensor excepted):
`check_groups_fit_shard` raises QuantizationError otherwise, naming the layer and the sizes.

Embeddings and the LM head stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.ops import (
    BLOCK_GROUP_SIZE,
    INT4_GROUP_SIZES,
    INT4_ROW_MULTIPLE,
    SCALE_DTYPE,
    BlockQuantWeight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    pack_int4,
)

METHODS = ("auto", "none", "int8", "int4")
DEFAULT_INT4_GROUP_SIZE = 32  # the accuracy table in docs/quantization-accuracy.md
GGUF_GROUP_SIZE = 32  # Q4_0, Q4_1 and Q8_0 blocks
_TINY_SCALE = 1e-12  # all-zero rows or groups: any positive scale reproduces them exactly


class QuantizationError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """`method` auto|none|int8|int4; `group_size` for int4 (None: DEFAULT_INT4_GROUP_SIZE), ignored by int8 (per channel)."""

    method: str = "none"
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantizationError(f"quantization must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.group_size is not None and self.group_size not in INT4_GROUP_SIZES:
            raise QuantizationError(f"quantization group size must be one of "
                                    f"{', '.join(map(str, INT4_GROUP_SIZES))}, not {self.group_size}")

    @property
    def is_enabled(self) -> bool:
        """Whether dense weights are quantized after the load."""
        return self.method in ("int8", "int4")

    @property
    def keeps_checkpoint_quantization(self) -> bool:
        """Whether a GGUF's quantized linear weights are packed as they are (auto)."""
        return self.method == "auto"

    @property
    def int4_group_size(self) -> int:
        return self.group_size or DEFAULT_INT4_GROUP_SIZE


def _bf16(values: torch.Tensor) -> torch.Tensor:
    """Rounded to the stored scale dtype, returned as float32 for the arithmetic."""
    return values.to(SCALE_DTYPE).to(torch.float32)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """weight [N, K] float -> symmetric int8 with one bfloat16 scale per row (on the CPU)."""
    weight = weight.detach().to("cpu", torch.float32)
    scales = _bf16((weight.abs().amax(dim=1) / 127.0).clamp_min(_TINY_SCALE))  # [N]
    qweight = torch.round(weight / scales[:, None]).clamp_(-128, 127).to(torch.int8)  # [N, K]
    return Int8Weight(qweight=qweight, scales=scales.to(SCALE_DTYPE))


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> Int4Weight:
    """weight [N, K] float -> asymmetric int4 in groups of `group_size` along K (see the module doc),
    packed on the CPU (the packing op is a CPU one)."""
    if group_size not in INT4_GROUP_SIZES:
        raise QuantizationError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {group_size}")
    num_rows, num_cols = weight.shape
    if num_rows % INT4_ROW_MULTIPLE:
        raise QuantizationError(f"int4 needs output rows in multiples of {INT4_ROW_MULTIPLE}, not {num_rows}")
    weight = weight.detach().to("cpu", torch.float32)
    padded = -(-num_cols // group_size) * group_size
    if padded != num_cols:  # repeat the last column: the short group's range stays its own
        weight = torch.cat([weight, weight[:, -1:].expand(num_rows, padded - num_cols)], dim=1)
    groups = weight.view(num_rows, padded // group_size, group_size)  # [N, groups, G]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, groups]
    scales = _bf16(((high - low) / 15.0).clamp_min(_TINY_SCALE))  # [N, groups]
    zeros = _bf16(low + 8.0 * scales)  # [N, groups]: the value of code 8, as stored
    # the rounded zero may sit off-centre: where the grid zero - 8 * step .. zero + 7 * step no longer
    # reaches each end within half a step, the smallest bfloat16 step that does (rounded up by 2^-7)
    needed = torch.maximum((high - zeros) / 7.5, (zeros - low) / 8.5)
    scales = torch.where(scales >= needed, scales, _bf16(needed * (1.0 + 2.0 ** -7)))  # [N, groups]
    # codes against the stored (scale, zero): w ~= (c - 8) * scale + zero
    codes = torch.round((groups - zeros[..., None]) / scales[..., None] + 8.0).clamp_(0, 15)  # [N, groups, G]
    codes = codes.view(num_rows, padded)
    if padded != num_cols:
        codes[:, num_cols:] = 0
    return _int4_from_codes(codes, scales, zeros - 8.0 * scales, group_size, num_cols)


def _int4_from_codes(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                     in_features: int) -> Int4Weight:
    """codes [N, K_padded] in 0..15, W = codes * scales + offsets per [N, groups] -> the kernel form,
    whose zero is the value of code 8: zero = offset + 8 * scale."""
    zeros = offsets.to(torch.float32) + 8.0 * scales.to(torch.float32)  # [N, groups]
    scales_and_zeros = torch.stack([scales.to(torch.float32), zeros], dim=-1)  # [N, groups, 2]
    return Int4Weight(packed=pack_int4(codes), scales_and_zeros=scales_and_zeros.transpose(0, 1).contiguous()
                      .to(SCALE_DTYPE), group_size=group_size, in_features=in_features)


def quantize(weight: torch.Tensor, config: QuantizationConfig) -> PackedWeight:
    if config.method == "int8":
        return quantize_int8(weight)
    if config.method == "int4":
        return quantize_int4(weight, config.int4_group_size)
    raise QuantizationError(f"nothing to quantize with method {config.method!r}")


def check_groups_fit_shard(layer_name: str, full_size: int, start: int, size: int, group_size: int) -> None:
    """Raises QuantizationError when int4 groups of the whole input dimension would cross this
    rank's input range [start, start + size)."""
    is_last = start + size == full_size
    if start % group_size or (size % group_size and not is_last):
        raise QuantizationError(
            f"{layer_name}: int4 groups of {group_size} inputs would straddle a tensor-parallel shard "
            f"boundary: this rank holds inputs {start}..{start + size - 1} of {full_size}; pick a "
            f"--quantization-group-size that divides {size} (one of {', '.join(map(str, INT4_GROUP_SIZES))})")


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight [N, K] that arrives already quantized (GGUF Q4_0, Q4_1, Q8_0), in groups of
    `group_size` consecutive inputs of one output row:

        W[n, k] = scales[n, g] * values[n, k] + offsets[n, g]      g = k // group_size

        Q4_0   bits 4, values uint8 0..15, scales d, offsets -8 * d     (w = d * (q - 8))
        Q4_1   bits 4, values uint8 0..15, scales d, offsets m          (w = d * q + m)
        Q8_0   bits 8, values int8 -128..127, scales d, offsets None    (w = d * q)

    values [N, K] hold one code per element (unpacked); scales and offsets are [N, K / group_size]
    in any float dtype. The GGUF loader (pagedserve.worker.loading.gguf_weights) builds one per
    slice of a checkpoint tensor that this rank holds (in the Hugging Face [out, in] orientation)
    and hands a layer's slices to `pagedserve.worker.quantization.linear.pack_parts`, which fuses
    q/k/v and gate/up and packs them for the block kernels exactly as they are: codes, float16
    scales and minimums (`to_packed`).
    """

    bits: int
    values: torch.Tensor  # [N, K]
    scales: torch.Tensor  # [N, K / group_size]
    offsets: torch.Tensor | None  # [N, K / group_size] or None (symmetric)
    group_size: int = GGUF_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise QuantizationError(f"pre-quantized weights have 4 or 8 bits, not {self.bits}")
        if self.values.dim() != 2 or self.group_size <= 0 or self.values.shape[1] % self.group_size:
            raise QuantizationError(f"values {tuple(self.values.shape)} do not split into groups of {self.group_size}")
        groups_shape = (self.values.shape[0], self.values.shape[1] // self.group_size)
        for name in ("scales", "offsets"):
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != groups_shape:
                raise QuantizationError(f"{name} {tuple(tensor.shape)} must be {groups_shape} for values "
                                        f"{tuple(self.values.shape)} in groups of {self.group_size}")
        if self.bits == 8 and self.offsets is not None:
            raise QuantizationError("8-bit pre-quantized weights are symmetric (offsets None)")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        num_rows, num_cols = self.shape
        groups = self.values.to(torch.float32).view(num_rows, -1, self.group_size)
        weight = groups * self.scales.to(torch.float32)[..., None]
        if self.offsets is not None:
            weight = weight + self.offsets.to(torch.float32)[..., None]
        return weight.view(num_rows, num_cols)

    def has_format_of(self, other: QuantizedWeight) -> bool:
        return (self.bits, self.group_size, self.offsets is None) == (other.bits, other.group_size,
                                                                        other.offsets is None)

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Fused layers (q/k/v, gate/up): the parts' rows in order; all parts share one format."""
        first = parts[0]
        if not all(part.has_format_of(first) for part in parts):
            raise QuantizationError("fused pre-quantized weights differ in bits, group size or offsets")
        offsets = None if first.offsets is None else torch.cat([part.offsets for part in parts])
        return QuantizedWeight(first.bits, torch.cat([part.values for part in parts]),
                               torch.cat([part.scales for part in parts]), offsets, first.group_size)

    def to_packed(self) -> BlockQuantWeight:
        """The kernel form: the codes with the file's float16 scales and minimums, exactly (Q4_0's
        minimum -8 d is exact in float16), for the block kernels (kernels/linear/block_quant.py)."""
        if self.group_size != BLOCK_GROUP_SIZE:
            raise QuantizationError(f"pre-quantized groups of {self.group_size} inputs: the block kernels "
                                    f"take groups of {BLOCK_GROUP_SIZE}")
        try:
            return BlockQuantWeight.from_codes(self.values, self.scales, self.offsets, self.bits)
        except ValueError as error:
            raise QuantizationError(str(error)) from error
