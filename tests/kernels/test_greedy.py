"""The native greedy kernel (kernels/native/greedy.c) against its torch reference
(kernels/sampling/greedy.py greedy_ref): the same indices always, log probabilities within float32
rounding, on ties, NaNs, infinities, vocabularies that are not a multiple of 16 and strided rows."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.kernels.sampling import greedy


def _native(logits: torch.Tensor):
    lib = greedy.supports(logits)
    if lib is None:
        pytest.fail("the native library is unavailable (it needs a C compiler)")
    return greedy.greedy_native(logits, lib)


def _assert_same(logits: torch.Tensor) -> None:
    ids, logprobs = _native(logits)
    ref_ids, ref_logprobs = greedy.greedy_ref(logits)
    assert ids == ref_ids
    for got, want in zip(logprobs, ref_logprobs):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 1000), (32, 4099), (5, 7)])
def test_native_greedy_matches_the_torch_ops(dtype, rows, vocab):
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab)) * 4).to(dtype)
    _assert_same(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nans_and_infinities_as_torch_gives_them(dtype):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[0, 17] = logits[0, 250] = 50.0  # a tie: the lower index
    logits[1, 299] = 50.0  # the maximum in the tail after the last 16 values
    logits[2, 40] = float("nan")
    logits[2, 90] = float("nan")  # the first NaN wins
    logits[3] = float("-inf")  # every value -inf
    logits[4, 5] = float("inf")
    logits[5, 3] = float("-inf")  # one -inf among finite values
    _assert_same(logits)
    ids, logprobs = _native(logits)
    assert ids[:3] == [17, 299, 40] and math.isnan(logprobs[2]) and math.isnan(logprobs[3])


def test_strided_rows_and_the_ops_dispatch(monkeypatch):
    """Rows of a wider tensor (a padded vocabulary) read only their first `vocab` values; with the
    reference kernels selected ops.greedy runs the torch ops."""
    wide = torch.randn(4, 1100, generator=torch.Generator().manual_seed(2))
    wide[:, 1000:] = 1e6  # padding beyond the vocabulary, never chosen
    logits = wide[:, :1000]
    assert ops.greedy(logits)[0] == greedy.greedy_ref(logits)[0] == logits.argmax(dim=-1).tolist()
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    assert ops.greedy(logits) == greedy.greedy_ref(logits)
