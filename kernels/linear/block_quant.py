"""GGUF's block-quantized linear weights (Q4_0, Q4_1, Q8_0) kept exactly as the file has them, and
their matmuls: the native kernel at a few rows (kernels/native/block_quant_rows.c), an exact
dequantize-then-matmul above, and the reference.

    BlockQuantWeight   bits 4: qs uint8 [N, K / 2], two codes 0..15 per byte in ggml's order (byte
                              j of a group of 32: value j in the low nibble, j + 16 in the high);
                              scales and mins float16 [N, K / 32];   w = q * d + m
                              (Q4_0 is the case m = -8 d, exact in float16)
                       bits 8: qs int8 [N, K], scales float16 [N, K / 32], mins None;  w = q * d

The scales and minimums are the file's float16 values, never rounded to another type, and
`dequantize()` computes q * d + m in float32 as gguf.quants.dequantize does, so it equals the
gguf package's values bit for bit.

    block_quant_linear_native   1..MAX_ROWS rows: float32 activations against the codes, group
                                sums scaled by d in float32 (the kernel's comment): differs from
                                the reference only in the order of float32 sums. bfloat16
                                activations, 1..EXACT_ROWS rows: the same exact weights, by BF16
                                dot products on the codes (exact in bfloat16) scaled per group in
                                float32, so again only the order of float32 sums differs; more
                                rows: against the weights decoded to bfloat16 (the file
                                dequantized to bfloat16, as `none` has them), a column block at a
                                time, up to the rows the host's tuning measured the decoded panels
                                faster than the dequantized matmul (tuning.block_panel_rows, at
                                least MAX_ROWS): a prompt's prefill too. With AVX2 but not
                                AVX-512 (block_quant_rows_avx2.c) the float32 paths alone:
                                bfloat16 activations up to EXACT_ROWS go through them as float32
                                (the same exact weights), more through the dequantized matmul
    block_quant_linear_dequant  more rows: the weight dequantized exactly to float32 and, for a
                                float32 x, one float32 matmul; for a bfloat16 x, the weight
                                rounded to bfloat16 as the dequantized file served in bfloat16 has it
                                (`dequantize`: one native pass, else the torch ops)
    block_quant_linear_ref      the reference (the oracle in tests): the exact float32 weight (for a
                                bfloat16 x of more than EXACT_ROWS rows rounded to bfloat16), one
                                float32 matmul
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from pagedserve.kernels.native import library as native_lib
from pagedserve.kernels.native import tuning
from pagedserve.kernels.native.abi import DTYPE_CODES

GROUP_SIZE = 32
MAX_ROWS = 32  # the C kernel's BLOCK_QUANT_MAX_ROWS
EXACT_ROWS = 8  # its EXACT_ROWS: up to this many bfloat16 rows, the exact weights (module doc)


@dataclass(frozen=True, slots=True)
class BlockQuantWeight:
    qs: torch.Tensor  # bits 4: uint8 [N, K / 2]; bits 8: int8 [N, K]
    scales: torch.Tensor  # float16 [N, K / 32]
    mins: torch.Tensor | None  # float16 [N, K / 32] (bits 4) or None (bits 8)
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"block-quantized weights have 4 or 8 bits, not {self.bits}")
        codes_dtype = torch.uint8 if self.bits == 4 else torch.int8
        if self.qs.dtype != codes_dtype or self.qs.dim() != 2:
            raise ValueError(f"{self.bits}-bit codes must be a 2-D {codes_dtype} tensor, not {self.qs.dtype} "
                             f"{tuple(self.qs.shape)}")
        groups = (self.qs.shape[0], self.in_features // GROUP_SIZE)
        if self.in_features % GROUP_SIZE or self.scales.dtype != torch.float16 or tuple(self.scales.shape) != groups:
            raise ValueError(f"scales must be float16 {groups} for codes {tuple(self.qs.shape)}, not "
                             f"{self.scales.dtype} {tuple(self.scales.shape)}")
        if (self.mins is None) != (self.bits == 8) or (
                self.mins is not None and (self.mins.dtype != torch.float16 or self.mins.shape != self.scales.shape)):
            raise ValueError("4-bit weights need float16 mins shaped like their scales; 8-bit weights have none")

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (2 if self.bits == 4 else 1)

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"qs": self.qs, "scales": self.scales}
        return named if self.mins is None else {**named, "mins": self.mins}

    def codes(self) -> torch.Tensor:
        """[N, K] uint8 0..15 (bits 4) or int8 (bits 8), one code per weight in input order."""
        if self.bits == 8:
            return self.qs
        num_rows = self.qs.shape[0]
        groups = self.qs.view(num_rows, -1, GROUP_SIZE // 2)  # [N, groups, 16]
        return torch.cat([groups & 15, groups >> 4], dim=-1).view(num_rows, -1)  # low nibbles first

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        num_rows, num_cols = self.out_features, self.in_features
        codes = self.codes().to(torch.float32).view(num_rows, -1, GROUP_SIZE)  # [N, groups, 32]
        weight = codes * self.scales.to(torch.float32)[..., None]
        if self.mins is not None:
            weight = weight + self.mins.to(torch.float32)[..., None]
        return weight.view(num_rows, num_cols).to(dtype)

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> BlockQuantWeight:
        """codes [N, K] (0..15 for bits 4, -128..127 for bits 8), float16-valued scales and mins [N, K / 32]."""
        num_rows = codes.shape[0]
        if bits == 4:
            groups = codes.to(torch.uint8).view(num_rows, -1, GROUP_SIZE)  # [N, groups, 32]
            qs = (groups[..., :GROUP_SIZE // 2] | (groups[..., GROUP_SIZE // 2:] << 4)).view(num_rows, -1)
        else:
            qs = codes.to(torch.int8)
        return BlockQuantWeight(qs.contiguous(), _exact_f16(scales, "scales"),
                                None if mins is None else _exact_f16(mins, "mins"), bits)


def _exact_f16(values: torch.Tensor, name: str) -> torch.Tensor:
    half = values.to(torch.float16).contiguous()
    if not torch.equal(half.to(values.dtype), values):
        raise ValueError(f"block-quantized {name} must be float16 values (a GGUF file's)")
    return half


def supports(x: torch.Tensor, weight: BlockQuantWeight):
    """The native library when x [M, K] is a CPU tensor with 1 <= M <= MAX_ROWS, or a bfloat16 one
    with up to the host's tuned rows for the decoded panels (kernels/native/tuning.py
    block_panel_rows), and the CPU has the kernel (AVX-512, or AVX2 with FMA and F16C; the BF16
    variant for the latter, AVX-512 BF16, without which bfloat16 x goes up to EXACT_ROWS), else None."""
    if not (x.device.type == "cpu" and x.dim() == 2 and 0 < x.shape[0] and weight.qs.device.type == "cpu"):
        return None
    lib = native_lib.load()
    if lib is None or not native_lib.has_kernel(lib, "block_quant_rows"):
        return None
    if x.dtype == torch.bfloat16 and not _has_bf16(lib):
        # the float32 kernel multiplies the exact weights: bfloat16 rows past EXACT_ROWS take the
        # weights rounded to bfloat16 (the dequantized matmul), as the reference and the BF16 variant do
        return lib if x.shape[0] <= EXACT_ROWS else None
    if x.shape[0] <= MAX_ROWS:
        return lib
    return lib if x.dtype == torch.bfloat16 and x.shape[0] <= tuning.block_panel_rows(lib) else None


def block_quant_linear_native(x: torch.Tensor, weight: BlockQuantWeight, bias: torch.Tensor | None = None,
                              lib=None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype (callers check supports first). bfloat16 x goes to the BF16
    variant where the CPU has it (weights rounded to bfloat16), anything else to the float32 kernel."""
    lib = lib or native_lib.load()
    y = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    if x.dtype == torch.bfloat16 and _has_bf16(lib):
        kernel, x_in = lib.block_quant_rows_bf16, x.contiguous()
    else:
        kernel, x_in = lib.block_quant_rows, x.to(torch.float32).contiguous()
    kernel(
        x_in.data_ptr(), weight.qs.data_ptr(), weight.scales.data_ptr(),
        weight.mins.data_ptr() if weight.mins is not None else None, y.data_ptr(), x.shape[0],
        weight.out_features, weight.in_features, weight.bits)
    return _finish(y, bias, x.dtype)


def bound_block_quant_linear(x: torch.Tensor, weight: BlockQuantWeight, bias: torch.Tensor | None, out: torch.Tensor,
                             lib):
    """block_quant_linear_native(x, weight, bias) written into out [M, N] (x's dtype, contiguous) as a
    call without arguments bound to these tensors (supports(x, weight) holds, x contiguous; the
    caller keeps them alive and changes only their values): the same kernel, sum and rounding.
    None where the native path would first convert x (bfloat16 x without the BF16 variant)."""
    if x.dtype == torch.bfloat16 and _has_bf16(lib):
        kernel = lib.block_quant_rows_bf16
    elif x.dtype == torch.float32:
        kernel = lib.block_quant_rows
    else:
        return None
    y = out if out.dtype == torch.float32 and bias is None else torch.empty(out.shape, dtype=torch.float32)
    call = partial(kernel, x.data_ptr(), weight.qs.data_ptr(), weight.scales.data_ptr(),
                   weight.mins.data_ptr() if weight.mins is not None else None, y.data_ptr(), x.shape[0],
                   weight.out_features, weight.in_features, weight.bits)
    if y is out:
        return call
    bias32 = bias.to(torch.float32) if bias is not None else None

    def run() -> None:
        call()
        out.copy_(y + bias32 if bias32 is not None else y)  # _finish's sum and rounding
    if bias32 is None and out.dtype == torch.bfloat16:
        run.rounds_into = (call, out)  # the kernel's call, then y rounded into out (kernels/layer/decode_run.py)
    return run


def _has_bf16(lib) -> bool:
    return native_lib.has_kernel(lib, "block_quant_rows_bf16")


def block_quant_linear_dequant(x: torch.Tensor, weight: BlockQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    compute = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    y = F.linear(x.to(compute), dequantize(weight, compute))
    return _finish(y, bias, x.dtype)


def dequantize(weight: BlockQuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """weight.dequantize(float32).to(dtype), for float32 or bfloat16, in one native pass where the
    CPU has the kernel (a prefill step dequantizes every kept projection; the torch ops took longer
    than the matmul at 256 rows), the same values either way."""
    lib = native_lib.load() if weight.qs.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
    if lib is not None:
        out = torch.empty(weight.out_features, weight.in_features, dtype=dtype)
        if lib.block_quant_dequantize(weight.qs.data_ptr(), weight.scales.data_ptr(),
                                      weight.mins.data_ptr() if weight.mins is not None else None, out.data_ptr(),
                                      weight.out_features, weight.in_features, weight.bits,
                                      DTYPE_CODES[dtype]):
            return out
    return weight.dequantize(torch.float32).to(dtype)


def block_quant_linear_ref(x: torch.Tensor, weight: BlockQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T in float32, W the exact float32 weights, or for a bfloat16 x of more than EXACT_ROWS
    rows the weights rounded to bfloat16 (the file dequantized to bfloat16)."""
    dense = weight.dequantize(torch.float32)
    if x.dtype == torch.bfloat16 and x.shape[0] > EXACT_ROWS:
        dense = dense.to(torch.bfloat16).to(torch.float32)
    y = F.linear(x.to(torch.float32), dense)  # [M, N]
    return _finish(y, bias, x.dtype)


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(dtype)
