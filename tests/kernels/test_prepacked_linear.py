"""bfloat16 linear layers with oneDNN-prepacked weights equal F.linear on the dense weight bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.linear.onednn import (
    can_prepack,
    prepack_linear_weight,
    prepacked_linear,
    prepacked_linear_ref,
)

pytestmark = pytest.mark.skipif(not can_prepack(torch.zeros(2, 2, dtype=torch.bfloat16)),
                                reason="this CPU or torch build has no oneDNN bfloat16 matmul")


@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (3072, 576), (130, 48)])
@pytest.mark.parametrize("num_rows", [1, 3, 32, 300])
def test_prepacked_equals_f_linear(out_features, in_features, num_rows):
    generator = torch.Generator().manual_seed(out_features * 7 + num_rows)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    x = torch.randn(num_rows, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    packed = prepack_linear_weight(weight)
    for b in (None, bias):
        assert torch.equal(prepacked_linear(x, packed, b), prepacked_linear_ref(x, weight, b))
    rows = torch.randn(num_rows, in_features + 40, generator=generator).to(torch.bfloat16)[:, 7:7 + in_features]
    assert torch.equal(prepacked_linear(rows, packed, None), prepacked_linear_ref(rows, weight, None))


def test_only_bfloat16_cpu_matrices_qualify():
    assert can_prepack(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not can_prepack(torch.zeros(4, 8))
    assert not can_prepack(torch.zeros(4, 8, dtype=torch.float16))
    assert not can_prepack(torch.zeros(8, dtype=torch.bfloat16))
