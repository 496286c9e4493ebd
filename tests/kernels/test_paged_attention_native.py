"""The native decode attention (kernels/attention/native.py, decode_attention.c) against the
reference on the NaN-filled pools of build_paged_batch, alone and through ops.paged_attention,
which sends a batch's decodes to it and its prefill chunks to the native prefill kernel or SDPA
(tests/kernels/test_prefill_attention_native.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.kernels.native import library as native_lib
from pagedserve.kernels.attention.native import NativeRows, paged_decode_attention, plan_native_rows, supports
from pagedserve.kernels.attention.reference import paged_attention_ref
from tests.kernels.conftest import build_paged_batch

pytestmark = pytest.mark.skipif(native_lib.compiler() is None or native_lib.load() is None,
                                reason="needs a C compiler")


def _batch(seqs, *, num_heads=9, num_kv_heads=3, head_size=64, block_size=16, dtype=torch.float32, seed=0):
    return build_paged_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                             block_size=block_size, dtype=dtype, device=torch.device("cpu"), seed=seed)


def _check(batch, assert_matches, sliding_window=None, k_scale=1.0, v_scale=1.0):
    scale = batch.query.shape[-1] ** -0.5
    expected = paged_attention_ref(*batch.args(), scale, sliding_window, k_scale, v_scale)
    assert supports(batch.query, batch.key_cache, batch.value_cache) is not None
    actual = ops.paged_attention(*batch.args(), scale, sliding_window, k_scale, v_scale, {})
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert_matches(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1), (12, 4)])
def test_decodes_over_gqa_ratios(dtype, num_heads, num_kv_heads, assert_matches):
    seqs = [(40, 1), (15, 1), (0, 1), (63, 1), (100, 1), (16, 1)]
    _check(_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype), assert_matches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batches(dtype, assert_matches):
    seqs = [(0, 17), (40, 1), (15, 1), (3, 9), (0, 1), (63, 1), (31, 33), (100, 1)]
    _check(_batch(seqs, dtype=dtype), assert_matches)
    _check(_batch([(0, 20), (5, 3)], dtype=dtype), assert_matches)  # no decode at all


@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_head_and_block_sizes_at_block_boundaries(head_size, block_size, assert_matches):
    seqs = [(block_size - 1, 1), (block_size, 1), (2 * block_size - 1, 1), (block_size + 1, 1), (0, 1),
            (257, 1)]
    _check(_batch(seqs, num_heads=4, num_kv_heads=2, head_size=head_size, block_size=block_size), assert_matches)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 40, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(sliding_window, dtype, assert_matches):
    seqs = [(0, 50), (70, 1), (5, 1), (16, 1), (47, 3), (0, 1), (200, 1)]
    _check(_batch(seqs, num_heads=8, num_kv_heads=2, dtype=dtype), assert_matches, sliding_window=sliding_window)


def test_kv_scales_fold_into_the_scores_and_the_output(assert_matches):
    _check(_batch([(30, 1), (7, 1), (0, 12)]), assert_matches, k_scale=0.7, v_scale=1.9)


def test_strided_queries_of_a_fused_projection(assert_matches):
    """The query heads as the model passes them: a view into the QKV output, rows strided."""
    batch = _batch([(33, 1), (64, 1), (2, 1)])
    num_tokens, num_heads, head_size = batch.query.shape
    fused = torch.randn(num_tokens, (num_heads + 6) * head_size)
    fused[:, : num_heads * head_size] = batch.query.reshape(num_tokens, -1)
    query = fused[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    assert not query.is_contiguous()
    scale = head_size ** -0.5
    expected = paged_attention_ref(*batch.args(), scale)
    assert_matches(ops.paged_attention(query, *batch.args()[1:], scale), expected)


def test_long_contexts_and_many_sequences(assert_matches):
    generator = torch.Generator().manual_seed(5)
    seqs = [(int(length), 1) for length in torch.randint(1, 700, (40,), generator=generator)]
    _check(_batch(seqs, dtype=torch.bfloat16, seed=3), assert_matches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count(dtype, assert_matches):
    """A context longer than one run of positions is split over tasks and merged; the runs depend on
    its positions only, so its output is the same bits whether it is attended alone or beside
    others, on one thread or two (a request's tokens must not depend on the batch it lands in)."""
    seqs = [(700, 1), (5, 1), (129, 1), (300, 1), (127, 1), (1000, 1)]
    batch = _batch(seqs, dtype=dtype, seed=4)
    decodes = plan_native_rows(*batch.args()[3:])
    scale, lib = 0.125, native_lib.load()

    def attend(rows: list[int], threads: int) -> torch.Tensor:
        out = torch.full_like(batch.query, float("nan"))
        chosen = NativeRows(torch.tensor(rows), decodes.prefills, decodes.block_tables, decodes.seq_lens,
                            decodes.query_start_loc)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            paged_decode_attention(lib, batch.query, batch.key_cache, batch.value_cache, out, chosen, scale, None, 1.0)
        finally:
            torch.set_num_threads(previous)
        return out

    together = attend(list(range(len(seqs))), 2)
    assert_matches(together, paged_attention_ref(*batch.args(), scale))
    for row in range(len(seqs)):
        for threads in (1, 2):
            assert torch.equal(attend([row], threads)[row], together[row]), (row, threads)
    assert torch.equal(attend(list(range(len(seqs))), 1), together)


def test_a_float32_cache_under_bfloat16_queries(assert_matches):
    batch = _batch([(20, 1), (45, 1)])
    query = batch.query.bfloat16()
    scale = 0.125
    expected = paged_attention_ref(query, *batch.args()[1:], scale)
    out = torch.empty_like(query)
    decodes = plan_native_rows(*batch.args()[3:])
    paged_decode_attention(native_lib.load(), query, batch.key_cache, batch.value_cache, out, decodes, scale,
                           None, 1.0)
    assert_matches(out, expected)


def test_what_it_does_not_take():
    batch = _batch([(5, 1)])
    fp8 = batch.key_cache.to(torch.float8_e4m3fn)
    assert supports(batch.query, fp8, fp8) is None
    assert supports(batch.query.half(), batch.key_cache.half(), batch.value_cache.half()) is None
    wide = _batch([(5, 1)], num_heads=65, num_kv_heads=1, head_size=16)
    assert supports(wide.query, wide.key_cache, wide.value_cache) is None
