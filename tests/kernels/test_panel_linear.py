"""The bfloat16 panel kernel (kernels/native/panel_linear.c, kernels/linear/panels.py) against its
reference: F.linear on the panels unpacked, and a float64 product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.linear import panels

pytestmark = pytest.mark.skipif(panels.library() is None, reason="needs a C compiler and AVX-512 BF16")


@pytest.mark.parametrize("size_out,size_in", [(960, 576), (40, 64), (17, 2), (576, 1536), (3, 34), (100, 6)])
def test_pack_keeps_every_weight_and_pads_the_last_panel_with_zeros(size_out, size_in):
    weight = torch.randn(size_out, size_in).bfloat16()
    packed = panels.pack(weight)
    num_panels = -(-size_out // panels.PANEL)
    assert packed.data.shape == (num_panels * panels.PANEL * size_in,) and packed.data.is_contiguous()
    assert torch.equal(panels.unpack(packed), weight)
    # weight[16 j + c, 2 p + e] sits in block b = j // 3 of P = min(3, panels left) panels, at
    # 3 b panels' elements + ((p P + j - 3 b) 16 + c) 2 + e: a block's panels interleaved by pairs
    n, k = torch.meshgrid(torch.arange(size_out), torch.arange(size_in), indexing="ij")
    j, c, p, e = n // panels.PANEL, n % panels.PANEL, k // 2, k % 2
    first = j // panels.BLOCK_PANELS * panels.BLOCK_PANELS
    width = (num_panels - first).clamp(max=panels.BLOCK_PANELS)
    index = first * panels.PANEL * size_in + ((p * width + j - first) * panels.PANEL + c) * 2 + e
    assert torch.equal(packed.data[index], weight)
    padding = torch.ones(packed.data.shape, dtype=torch.bool)
    padding[index.flatten()] = False
    assert int(padding.sum()) == (num_panels * panels.PANEL - size_out) * size_in
    assert not packed.data[padding].any()


@pytest.mark.parametrize("num_rows", [1, 2, 7, 8, 9, 24, 33, 64, 65, 130])
@pytest.mark.parametrize("size_out,size_in", [(960, 576), (40, 64), (50, 1536), (16, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_a_float64_product_to_one_rounding(num_rows, size_out, size_in, with_bias):
    generator = torch.Generator().manual_seed(num_rows * 1000 + size_out + size_in)
    x = torch.randn(num_rows, size_in, generator=generator).bfloat16()
    weight = (torch.randn(size_out, size_in, generator=generator) / size_in ** 0.5).bfloat16()
    bias = torch.randn(size_out, generator=generator).bfloat16() if with_bias else None
    packed = panels.pack(weight)
    ours = panels.panel_linear(x, packed, bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert ours.shape == (num_rows, size_out) and ours.dtype == torch.bfloat16
    # float32 sums rounded once to bfloat16: within a bfloat16 unit in the last place of the exact value
    assert torch.all((ours.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5)
    reference = panels.panel_linear_ref(x, packed, bias)
    assert torch.allclose(ours.float(), reference.float(), rtol=2 ** -7, atol=1e-2)
    assert (ours != reference).float().mean() < 0.01  # another order of float32 sums: rarely another rounding


def test_each_row_is_independent_of_the_others():
    """A row's result does not depend on how many rows share the call or where it sits in a block."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(37, 576, generator=generator).bfloat16()
    packed = panels.pack(torch.randn(200, 576, generator=generator).bfloat16())
    whole = panels.panel_linear(x, packed, None)
    for first, last in [(0, 1), (5, 13), (30, 37), (8, 9)]:
        assert torch.equal(panels.panel_linear(x[first:last], packed, None), whole[first:last])


@pytest.mark.parametrize("num_rows", [1, 2, 5, 8, 9, 24])
def test_the_prefetch_changes_no_result(num_rows):
    """The first row block's prefetch distance (tuned per host for blocks of 1-8 rows) moves loads
    earlier, nothing else; a distance past the end of the panels included."""
    lib = panels.library()
    generator = torch.Generator().manual_seed(20 + num_rows)
    x = torch.randn(num_rows, 576, generator=generator).bfloat16()
    packed = panels.pack(torch.randn(200, 576, generator=generator).bfloat16())
    before = [lib.panel_linear_prefetch(rows) for rows in range(1, 9)]
    try:
        results = []
        for distance in (0, 64, 1536, 1 << 20):
            for rows in range(1, 9):
                lib.panel_linear_set_prefetch(rows, distance)
            assert [lib.panel_linear_prefetch(rows) for rows in range(1, 9)] == [distance] * 8
            results.append(panels.panel_linear(x, packed, None))
        lib.panel_linear_set_prefetch(3, -5)
        assert lib.panel_linear_prefetch(3) == 0
        lib.panel_linear_set_prefetch(9, 4096)  # only blocks of 1-8 rows have a distance
        assert lib.panel_linear_prefetch(9) == 0 and lib.panel_linear_prefetch(0) == 0
    finally:
        for rows, distance in enumerate(before, start=1):
            lib.panel_linear_set_prefetch(rows, distance)
    assert all(torch.equal(result, results[0]) for result in results[1:])


def test_leading_dimensions_strided_input_empty_rows_and_special_values():
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(48, 64, generator=generator).bfloat16()
    packed = panels.pack(weight)
    x = torch.randn(2, 5, 128, generator=generator).bfloat16()[..., ::2]  # not contiguous
    assert torch.equal(panels.panel_linear(x, packed, None),
                       panels.panel_linear(x.contiguous().reshape(10, 64), packed, None).reshape(2, 5, 48))
    assert panels.panel_linear(torch.empty(0, 64).bfloat16(), packed, None).shape == (0, 48)
    special = torch.zeros(3, 64).bfloat16()
    special[0, 0], special[1, 0] = float("nan"), float("inf")
    out = panels.panel_linear(special, packed, None)
    assert torch.isnan(out[0]).all() and not torch.isfinite(out[1]).any()
    # the rounding to bfloat16 keeps a denormal sum (here the bias of a zero product), as torch rounds
    bias = torch.full((48,), 1e-39).bfloat16()
    assert torch.equal(panels.panel_linear(torch.zeros(1, 64).bfloat16(), packed, bias), bias[None])


def test_odd_inputs_and_other_dtypes_are_not_packed():
    assert panels.can_pack(torch.zeros(8, 64, dtype=torch.bfloat16))
    assert not panels.can_pack(torch.zeros(8, 63, dtype=torch.bfloat16))
    assert not panels.can_pack(torch.zeros(8, 64))
    assert not panels.can_pack(torch.zeros(64, dtype=torch.bfloat16))
