"""The native prefill attention (kernels/attention/native.py, prefill_attention.c) against the
float32 reference on the NaN-filled pools of build_paged_batch: alone, through ops.paged_attention
beside decodes, at prefixes cached and not, at block, key-block and query-tile boundaries, with
sliding windows and KV scales. Its error is held to the tolerance of bfloat16 and to no more than
torch's own bfloat16 SDPA makes on the same batch (both round the softmax weights to bfloat16
before the V product)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.kernels.attention.native import (
    NativeRows, paged_prefill_attention, plan_native_rows, supports, supports_prefill,
)
from pagedserve.kernels.attention.reference import paged_attention_ref
from pagedserve.kernels.attention.sdpa import paged_attention_sdpa
from pagedserve.kernels.native import library as native_lib
from tests.kernels.conftest import build_paged_batch

def _available() -> bool:
    lib = native_lib.load() if native_lib.compiler() is not None else None
    return lib is not None and bool(lib.prefill_attention_available())


pytestmark = pytest.mark.skipif(not _available(), reason="needs a C compiler and a CPU with AVX-512 BF16")


def _batch(seqs, *, num_heads=9, num_kv_heads=3, head_size=64, block_size=16, seed=0):
    return build_paged_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                             block_size=block_size, dtype=torch.bfloat16, device=torch.device("cpu"), seed=seed)


def _prefill_rows(batch) -> torch.Tensor:
    starts = batch.query_start_loc.tolist()
    return torch.tensor([row for i in range(len(starts) - 1) if starts[i + 1] - starts[i] > 1
                         for row in range(starts[i], starts[i + 1])], dtype=torch.long)


def _kernel(batch, scale, sliding_window=None, v_scale=1.0, query=None, threads=None) -> torch.Tensor:
    query = batch.query if query is None else query
    out = torch.full_like(batch.query, float("nan"))
    rows = plan_native_rows(*batch.args()[3:])
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        assert paged_prefill_attention(native_lib.load(), query, batch.key_cache, batch.value_cache, out, rows, scale,
                                       sliding_window, v_scale)
    finally:
        torch.set_num_threads(previous)
    return out


def _check(batch, sliding_window=None, k_scale=1.0, v_scale=1.0):
    """The kernel's prefill rows against the float32 reference, and its error against SDPA's."""
    scale = batch.query.shape[-1] ** -0.5
    lib = supports(batch.query, batch.key_cache, batch.value_cache)
    assert lib is not None and supports_prefill(lib, batch.query, batch.key_cache)
    rows = _prefill_rows(batch)
    exact = paged_attention_ref(batch.query.float(), batch.key_cache.float(), batch.value_cache.float(),
                                *batch.args()[3:], scale, sliding_window, k_scale, v_scale)[rows]
    actual = _kernel(batch, scale * k_scale, sliding_window, v_scale)[rows]
    assert actual.dtype == torch.bfloat16 and not actual.isnan().any()
    torch.testing.assert_close(actual.float(), exact, atol=3e-2, rtol=3e-2)
    sdpa = paged_attention_sdpa(*batch.args(), scale, sliding_window, k_scale, v_scale)[rows]
    error, sdpa_error = (actual.float() - exact).abs().max(), (sdpa.float() - exact).abs().max()
    assert error <= 1.5 * sdpa_error + 1e-3, (error, sdpa_error)
    through_ops = ops.paged_attention(*batch.args(), scale, sliding_window, k_scale, v_scale, {})
    assert torch.equal(through_ops[rows], actual)
    return through_ops


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1), (12, 4)])
def test_whole_prompts_over_gqa_ratios(num_heads, num_kv_heads):
    _check(_batch([(0, 17), (0, 2), (0, 64), (0, 65), (0, 130)], num_heads=num_heads, num_kv_heads=num_kv_heads))


def test_chunks_after_a_cached_prefix_beside_decodes(assert_matches):
    """A prefill chunk's rows sit after its cached prefix (bottom-right aligned causal mask); the
    decodes of the same call go to the decode kernel."""
    batch = _batch([(40, 1), (31, 33), (15, 1), (3, 9), (100, 1), (63, 65), (200, 16), (0, 1)])
    out = _check(batch)
    decodes = [int(start) for start, end in zip(batch.query_start_loc[:-1], batch.query_start_loc[1:])
               if end - start == 1]
    assert_matches(out[decodes], paged_attention_ref(*batch.args(), batch.query.shape[-1] ** -0.5)[decodes])


@pytest.mark.parametrize("head_size", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_head_sizes_and_block_sizes(head_size, block_size):
    """Head sizes whose V sums take 2, 4, 4 + 2, 8 and 16 vectors; contexts across block ends,
    64-position key blocks and 16-position query tiles."""
    _check(_batch([(block_size - 1, 3), (0, 2 * block_size + 1), (63, 2), (1, 63), (64, 17)], num_heads=4,
                  num_kv_heads=2, head_size=head_size, block_size=block_size))


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 64, 70, 1000])
def test_sliding_window(sliding_window):
    _check(_batch([(0, 50), (47, 3), (130, 90), (0, 200)], num_heads=8, num_kv_heads=2), sliding_window=sliding_window)


def test_kv_scales_fold_into_the_scores_and_the_output():
    _check(_batch([(30, 7), (0, 12)]), k_scale=0.7, v_scale=1.9)


def test_strided_queries_of_a_fused_projection():
    """The query heads as the model passes them: a view into the QKV output, rows strided."""
    batch = _batch([(33, 20), (0, 70)])
    num_tokens, num_heads, head_size = batch.query.shape
    fused = torch.randn(num_tokens, (num_heads + 6) * head_size).bfloat16()
    fused[:, : num_heads * head_size] = batch.query.reshape(num_tokens, -1)
    query = fused[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    assert not query.is_contiguous()
    scale = head_size ** -0.5
    assert torch.equal(_kernel(batch, scale, query=query), _kernel(batch, scale))


def test_a_sequence_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count():
    """A sequence's sums run in an order fixed by its positions: its rows are the same bits alone or
    beside others, on one thread or two."""
    seqs = [(0, 300), (40, 17), (0, 5), (700, 64)]
    batch = _batch(seqs, seed=4)
    scale = 0.125
    together = _kernel(batch, scale, threads=2)
    rows = plan_native_rows(*batch.args()[3:])
    starts = batch.query_start_loc.tolist()
    for i in range(len(seqs)):
        alone = NativeRows(rows.seqs, torch.tensor([i]), rows.block_tables, rows.seq_lens, rows.query_start_loc)
        for threads in (1, 2):
            out = torch.full_like(batch.query, float("nan"))
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert paged_prefill_attention(native_lib.load(), batch.query, batch.key_cache, batch.value_cache, out, alone,
                                               scale, None, 1.0)
            finally:
                torch.set_num_threads(previous)
            assert torch.equal(out[starts[i]:starts[i + 1]], together[starts[i]:starts[i + 1]]), (i, threads)
            assert out[:starts[i]].isnan().all() and out[starts[i + 1]:].isnan().all()  # no other row written


def test_what_it_does_not_take():
    """float32 queries, float32 caches under bfloat16 queries and head sizes off the multiple of 32
    keep the SDPA path (ops.paged_attention still answers them)."""
    batch = _batch([(5, 9)])
    assert not supports_prefill(native_lib.load(), batch.query.float(), batch.key_cache.float())
    assert not supports_prefill(native_lib.load(), batch.query, batch.key_cache.float())
    odd = _batch([(5, 9)], head_size=80)
    assert not supports_prefill(native_lib.load(), odd.query, odd.key_cache)
    expected = paged_attention_ref(*odd.args(), 0.1)
    torch.testing.assert_close(ops.paged_attention(*odd.args(), 0.1).float(), expected.float(), atol=3e-2, rtol=3e-2)
