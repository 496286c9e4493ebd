"""The native few-rows bfloat16 linear (kernels/linear/native_rows.py) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.linear import native_rows
from pagedserve.kernels.native import library as native_lib

pytestmark = pytest.mark.skipif(native_lib.compiler() is None or not native_lib.load()
                                or not native_lib.load().linear_rows_available(),
                                reason="needs a C compiler and AVX-512 BF16")


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("size_out,size_in", [(960, 576), (7, 45), (130, 1536), (4, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_a_float32_product_to_one_rounding(num_rows, size_out, size_in, with_bias):
    generator = torch.Generator().manual_seed(num_rows * 1000 + size_in)
    x = torch.randn(num_rows, size_in, generator=generator).bfloat16()
    weight = (torch.randn(size_out, size_in, generator=generator) / size_in ** 0.5).bfloat16()
    bias = torch.randn(size_out, generator=generator).bfloat16() if with_bias else None
    ours = native_rows.linear_rows(x, weight, bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert ours.shape == (num_rows, size_out) and ours.dtype == torch.bfloat16
    # float32 sums rounded once to bfloat16: within a bfloat16 unit in the last place of the exact value
    assert torch.all((ours.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5)
    assert torch.allclose(ours.float(), native_rows.linear_rows_ref(x, weight, bias).float(), rtol=2 ** -7,
                          atol=1e-2)


def test_supports_only_few_contiguous_bfloat16_rows():
    weight = torch.randn(8, 32).bfloat16()
    assert native_rows.supports(torch.randn(1, 32).bfloat16(), weight)
    assert not native_rows.supports(torch.randn(native_rows.MAX_ROWS + 1, 32).bfloat16(), weight)
    assert not native_rows.supports(torch.randn(1, 32), weight.float())
    assert not native_rows.supports(torch.randn(32, 2).bfloat16().t(), weight)
    assert not native_rows.supports(torch.randn(0, 32).bfloat16(), weight)
    assert native_rows.supports(torch.randn(8, 32).bfloat16(), weight, max_rows=native_rows.KERNEL_MAX_ROWS)


def test_a_bfloat16_layer_uses_it_for_few_rows_and_onednn_for_many():
    from pagedserve.worker.layers.parallel import ColumnParallelLinear, ShardRange
    from pagedserve.worker.loading.prepacked_weights import prepack_model

    layer = ColumnParallelLinear(64, [ShardRange(96, 0, 96)], bias=False, dtype=torch.bfloat16, device="cpu")
    torch.nn.init.normal_(layer.weight)
    if not prepack_model(layer):
        pytest.skip("oneDNN bfloat16 is not available on this CPU")
    few, many = torch.randn(1, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    assert torch.equal(layer(few), native_rows.linear_rows(few, layer.weight, None))
    assert torch.equal(layer(many), F.linear(many, layer.weight))
