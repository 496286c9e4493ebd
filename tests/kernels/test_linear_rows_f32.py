"""The native few-rows float32 linear (kernels/native/linear_rows.c `linear_rows_f32`, AVX-512 or
its AVX2 twin) against F.linear: what decode_layer.c multiplies dense float32 weights with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.native import library as native_lib

LIB = native_lib.load()
pytestmark = pytest.mark.skipif(LIB is None or not native_lib.has_kernel(LIB, "linear_rows_f32"),
                                reason="needs a C compiler and AVX2 with FMA")


def _linear_rows_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.full((x.shape[0], weight.shape[0]), float("nan"))
    LIB.linear_rows_f32(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                        y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return y


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8])
# K a multiple of 16, of 8 only, and neither (the scalar tail)
@pytest.mark.parametrize("size_out,size_in", [(960, 576), (130, 1544), (7, 45), (3, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_exact_product_but_for_the_order_of_float32_sums(num_rows, size_out, size_in, with_bias):
    generator = torch.Generator().manual_seed(num_rows * 1000 + size_in)
    x = torch.randn(num_rows, size_in, generator=generator)
    weight = torch.randn(size_out, size_in, generator=generator) / size_in ** 0.5
    bias = torch.randn(size_out, generator=generator) if with_bias else None
    ours = _linear_rows_f32(x, weight, bias)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert float((ours.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max()) + 1e-6
    wrong = F.linear(x.double(), weight.double() * (1 + 1e-4))
    assert float((wrong - exact).abs().max()) > 1e-5 * float(exact.abs().max()) + 1e-6  # the bound tells them apart


def test_the_result_does_not_depend_on_the_thread_count():
    """Each output row is computed whole by one thread: the same bits at 1 to 7 threads."""
    generator = torch.Generator().manual_seed(3)
    previous = torch.get_num_threads()
    try:
        for num_rows, size_out, size_in in ((1, 3072, 576), (4, 577, 1536), (8, 1000, 72)):
            x = torch.randn(num_rows, size_in, generator=generator)
            weight = torch.randn(size_out, size_in, generator=generator)
            results = []
            for threads in (1, 2, 3, 7):
                torch.set_num_threads(threads)
                results.append(_linear_rows_f32(x, weight, None))
            assert all(torch.equal(result, results[0]) for result in results[1:]), (num_rows, size_out)
    finally:
        torch.set_num_threads(previous)
