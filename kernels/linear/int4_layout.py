"""PyTorch's CPU int4 weight packing, and its inverse in plain torch.

`torch._convert_weight_to_int4pack_for_cpu(codes [N, K] int32 in 0..15, 1)` returns a uint8
tensor reported as [N, K / 2] whose bytes are laid out for the CPU kernel, not row by row. The
layout depends on the ATen CPU capability (AVX512, AVX2, plain) but always has this shape:

    rows cut into blocks of BLOCK_N (64 on AVX512, 32 otherwise) and one shorter tail block;
    each block is one contiguous run of K x (block rows / 2) bytes, k-major:

        block b:  [k = 0: block_rows / 2 bytes][k = 1: ...] ... [k = K - 1: ...]

    and within one k, byte j holds two rows' codes (low and high nibble); which rows is a fixed
    pairing per block size (AVX512 pairs row d with row d + 32 in a 64-row block, AVX2 row d
    with d + 16, a tail block rows 2j and 2j + 1).

Rather than hard-coding the pairing per capability, `Int4Layout.probe(N)` packs a probe of K = 2
whose codes spell each row's index (4 bits per pass) and reads back the block sizes and the
pairings. `unpack_int4_columns` then rebuilds the codes, transposed to [K, N], with two nibble
shifts and two strided copies per run of equal blocks, in the layout's own row order (see there);
`unpack_int4` adds the one gather that restores row order. `check_round_trip` verifies a layout
on random codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import torch

PROBE_K = 2  # the smallest K the packing accepts
NIBBLE_BITS = 4


class Int4LayoutError(RuntimeError):
    """The packed bytes do not follow the block structure described in this module."""


@dataclass(frozen=True, slots=True)
class PackedBlock:
    """Rows [row_start, row_start + num_rows); byte c of a k-row holds row order[c] (c < num_rows / 2:
    low nibble of byte c, else high nibble of byte c - num_rows / 2)."""

    row_start: int
    num_rows: int
    order: tuple[int, ...]  # [num_rows] block-relative row of each nibble column


@dataclass(frozen=True)
class Int4Layout:
    num_rows: int
    blocks: tuple[PackedBlock, ...]

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(first row, number of blocks, rows per block) of consecutive blocks sharing one pairing."""
        runs: list[list] = []
        for block in self.blocks:
            previous = runs[-1] if runs else None
            if previous and previous[3] == block.order:
                previous[1] += 1
            else:
                runs.append([block.row_start, 1, block.num_rows, block.order])
        return tuple((row_start, count, rows) for row_start, count, rows, _ in runs)

    @cached_property
    def column_rows(self) -> torch.Tensor:
        """[N] int64: the row held by each column of unpack_int4_columns' output."""
        return torch.tensor([block.row_start + row for block in self.blocks for row in block.order])

    @cached_property
    def is_row_order(self) -> bool:
        """Whether unpack_int4_columns' columns are already rows 0..N-1 in order (AVX-512 and AVX2
        full blocks pair row d with d + 32, resp. d + 16, which puts the nibbles in row order)."""
        return bool(torch.equal(self.column_rows, torch.arange(self.num_rows)))

    @cached_property
    def row_positions(self) -> torch.Tensor:
        """[N] int64: the column of unpack_int4_columns' output holding each row (column_rows' inverse)."""
        return torch.argsort(self.column_rows)

    @staticmethod
    @cache
    def probe(num_rows: int) -> Int4Layout:
        """The layout torch uses for `num_rows` output rows on this machine (cached per size)."""
        if num_rows <= 0 or num_rows % 16:
            raise Int4LayoutError(f"int4 packing needs a positive row count divisible by 16, not {num_rows}")
        rows = torch.arange(num_rows, dtype=torch.int32)[:, None].expand(num_rows, PROBE_K)  # [N, 2]
        ks = torch.arange(PROBE_K, dtype=torch.int32)[None, :].expand(num_rows, PROBE_K)  # [N, 2]
        k_of_byte = _pack_bytes(ks)  # low nibble: the k of each byte (both nibbles share it)
        row_lo = torch.zeros(num_rows, dtype=torch.int64)  # [N bytes]
        row_hi = torch.zeros(num_rows, dtype=torch.int64)
        for shift in range(0, max(1, num_rows - 1).bit_length(), NIBBLE_BITS):
            packed = _pack_bytes((rows >> shift) & 15)  # [N bytes]
            row_lo |= (packed & 15).long() << shift
            row_hi |= (packed >> 4).long() << shift
        return Int4Layout(num_rows, _blocks(k_of_byte & 15, row_lo, row_hi, num_rows))


def _pack_bytes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, 2] int32 -> the packed bytes in memory order, [N] uint8."""
    return torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1).reshape(-1)


def _blocks(k_of_byte: torch.Tensor, row_lo: torch.Tensor, row_hi: torch.Tensor, num_rows: int) -> tuple:
    """Walks the probe's bytes: each block is half_rows bytes of k = 0, then half_rows of k = 1."""
    ks, lows, highs = k_of_byte.tolist(), row_lo.tolist(), row_hi.tolist()
    blocks, position, row_start = [], 0, 0
    while position < len(ks):
        half = 0
        while position + half < len(ks) and ks[position + half] == 0:
            half += 1
        if half == 0 or ks[position + half: position + 2 * half] != [1] * half:
            raise Int4LayoutError(f"int4 packing: no k-major block at byte {position}")
        order = [row - row_start for row in lows[position:position + half] + highs[position:position + half]]
        if sorted(order) != list(range(2 * half)):
            raise Int4LayoutError(f"int4 packing: block at byte {position} does not hold rows "
                                  f"{row_start}..{row_start + 2 * half - 1}")
        blocks.append(PackedBlock(row_start, 2 * half, tuple(order)))
        position += 2 * half
        row_start += 2 * half
    if row_start != num_rows:
        raise Int4LayoutError(f"int4 packing covers {row_start} rows, not {num_rows}")
    return tuple(blocks)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] integers in 0..15 -> PyTorch's CPU int4 layout, [N, K / 2] uint8."""
    if codes.dim() != 2 or codes.shape[0] % 16 or codes.shape[1] % 2:
        raise ValueError(f"int4 codes must be [N, K] with N divisible by 16 and K even, not {tuple(codes.shape)}")
    return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def unpack_int4_columns(packed: torch.Tensor, num_rows: int, num_cols: int) -> torch.Tensor:
    """packed (pack_int4's output) -> codes transposed [num_cols (K), num_rows (N)] uint8, with the
    rows in the layout's own order: column c holds row `Int4Layout.probe(N).column_rows[c]`.

    This order needs no gather (each block's low and high nibbles land side by side); a matmul
    against it yields output columns in the same order, which one index_select puts right.
    """
    layout = Int4Layout.probe(num_rows)
    flat = packed.reshape(-1)  # [N * K / 2] bytes in memory order
    out = torch.empty(num_cols, num_rows, dtype=torch.uint8, device=packed.device)  # [K, N], layout order
    offset = 0
    for row_start, num_blocks, block_rows in layout.runs:
        half = block_rows // 2
        num_bytes = num_blocks * num_cols * half
        raw = flat[offset:offset + num_bytes].view(num_blocks, num_cols, half)  # [blocks, K, rows / 2]
        target = out[:, row_start:row_start + num_blocks * block_rows].view(num_cols, num_blocks, block_rows)
        target[:, :, :half] = (raw & 15).transpose(0, 1)
        target[:, :, half:] = (raw >> 4).transpose(0, 1)
        offset += num_bytes
    return out


def unpack_int4(packed: torch.Tensor, num_rows: int, num_cols: int) -> torch.Tensor:
    """packed (pack_int4's output) -> codes [num_rows, num_cols] uint8 in 0..15, row by row."""
    layout = Int4Layout.probe(num_rows)
    columns = unpack_int4_columns(packed, num_rows, num_cols)  # [K, N] in layout order
    if not layout.is_row_order:
        columns = columns.index_select(1, layout.row_positions.to(packed.device))
    return columns.t().contiguous()


@cache
def check_round_trip(num_rows: int, num_cols: int) -> bool:
    """Whether unpack_int4 inverts pack_int4 for this shape on this machine (random codes)."""
    generator = torch.Generator().manual_seed(num_rows * 7919 + num_cols)
    codes = torch.randint(0, 16, (num_rows, num_cols), generator=generator, dtype=torch.int32)
    try:
        return torch.equal(unpack_int4(pack_int4(codes), num_rows, num_cols), codes.to(torch.uint8))
    except Int4LayoutError:
        return False
