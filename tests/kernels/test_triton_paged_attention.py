"""Triton paged attention against the plain-torch reference (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.kernels.attention.reference import paged_attention_ref

# (cached context, new tokens): decodes, a chunk after a cached prefix that starts and ends
# mid-block, a prefill from scratch, a sequence with no new tokens this step, a longer decode.
MIXED = [(47, 1), (0, 1), (21, 19), (0, 13), (5, 0), (70, 1)]
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
PAGED_ATTENTION = "pagedserve.kernels.attention.triton_kernel:paged_attention"


@pytest.fixture
def run_both(kernels):
    """(Triton output, reference output) for one batch."""
    def run(batch, scale=0.125, sliding_window=None, num_kv_splits=None):
        out = kernels.call(PAGED_ATTENTION, *batch.args(), scale, sliding_window, num_kv_splits=num_kv_splits)
        return out, paged_attention_ref(*batch.args(), scale, sliding_window)
    return run


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "block_size", "dtype"), [
    (4, 4, 64, 16, F16),  # MHA
    (8, 4, 80, 8, BF16),  # GQA 2, padded head size
    (8, 2, 96, 32, F32),  # GQA 4
    (8, 1, 128, 16, F16),  # MQA
    (4, 1, 80, 32, BF16),  # MQA, padded head size
    (6, 2, 64, 8, F32),  # group of 3 (not a power of two)
    (8, 8, 128, 8, BF16),
    (2, 1, 96, 16, F16),
])
def test_mixed_decode_prefill_batch(run_both, paged_batch, assert_matches, num_heads, num_kv_heads, head_size,
                                    block_size, dtype):
    batch = paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                        block_size=block_size, dtype=dtype)
    out, ref = run_both(batch, scale=head_size ** -0.5, num_kv_splits=1)
    assert_matches(out, ref)


@pytest.mark.parametrize("num_kv_splits", [2, 3, 8])
def test_split_k_matches_reference_and_unsplit(run_both, paged_batch, assert_matches, num_kv_splits):
    # 8 splits over at most 3 tiles leaves some splits empty: the reduction must ignore them.
    batch = paged_batch([(90, 1), (33, 2), (0, 1)], num_heads=4, num_kv_heads=2, head_size=64,
                        block_size=16, dtype=F32)
    out, ref = run_both(batch, num_kv_splits=num_kv_splits)
    assert_matches(out, ref)
    unsplit, _ = run_both(batch, num_kv_splits=1)
    torch.testing.assert_close(out, unsplit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("sliding_window", "num_kv_splits", "dtype"), [
    (1, 1, F32),  # each token sees only itself
    (16, 1, F16),  # window edge on a block edge
    (37, 1, BF16),
    (20, 3, F32),
])
def test_sliding_window(run_both, paged_batch, assert_matches, sliding_window, num_kv_splits, dtype):
    batch = paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_size=64, block_size=8, dtype=dtype)
    out, ref = run_both(batch, sliding_window=sliding_window, num_kv_splits=num_kv_splits)
    assert_matches(out, ref)
    full, _ = run_both(batch, num_kv_splits=1)
    assert not torch.allclose(out.float(), full.float(), atol=1e-2), "the window changed nothing"


def test_window_left_edge_at_every_offset(run_both, paged_batch, assert_matches):
    # decodes of 17..50 tokens with a window of 16: the first visible position takes every value
    # mod 32, so it falls on every slot of a block and of a KV tile, first and last ones included
    seqs = [(n - 1, 1) for n in range(17, 51)] + [(30, 40)]
    batch = paged_batch(seqs, num_heads=2, num_kv_heads=1, head_size=64, block_size=16, dtype=F32)
    out, ref = run_both(batch, sliding_window=16, num_kv_splits=1)
    assert_matches(out, ref)


def test_window_of_one_returns_own_value(run_both, paged_batch):
    batch = paged_batch([(6, 3)], num_heads=2, num_kv_heads=1, head_size=64, block_size=8, dtype=F32)
    out, _ = run_both(batch, sliding_window=1, num_kv_splits=1)
    table = batch.block_tables[0].tolist()
    own_values = torch.stack([batch.value_cache[table[pos // 8], pos % 8, 0] for pos in (6, 7, 8)])  # [3, hs]
    torch.testing.assert_close(out[:, 0], own_values)
    torch.testing.assert_close(out[:, 1], own_values)


def test_many_decode_sequences(run_both, paged_batch, assert_matches):
    lengths = torch.randint(0, 60, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = paged_batch([(n, 1) for n in lengths], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                        dtype=F16)
    out, ref = run_both(batch, num_kv_splits=1)
    assert_matches(out, ref)


def test_block_ids_above_2_pow_16(run_both, paged_batch, assert_matches):
    min_block_id = 2 ** 16 + 5
    batch = paged_batch([(40, 1), (10, 9)], num_heads=2, num_kv_heads=1, head_size=64, block_size=8,
                        dtype=F16, num_blocks=min_block_id + 16, min_block_id=min_block_id)
    assert int(batch.block_tables[:, :2].min()) >= min_block_id
    for num_kv_splits in (1, 2):
        out, ref = run_both(batch, num_kv_splits=num_kv_splits)
        assert_matches(out, ref)


def test_strided_query_from_fused_qkv(run_both, paged_batch, assert_matches):
    batch = paged_batch([(9, 4), (30, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=F16)
    qkv = torch.randn(batch.query.shape[0], 8, 64, dtype=F16, device=batch.query.device)  # [T, nh + 2 kvh, hs]
    qkv[:, :4] = batch.query
    batch.query = qkv[:, :4]  # a non-contiguous view, as the model hands it over
    out, ref = run_both(batch, num_kv_splits=1)
    assert_matches(out, ref)


def test_rejects_bad_inputs(kernels, paged_batch):
    batch = paged_batch([(3, 1)], num_heads=3, num_kv_heads=1, head_size=64, block_size=8, dtype=F32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.call(PAGED_ATTENTION, batch.query[:, :, :32], *batch.args()[1:], 0.1)
    with pytest.raises(TypeError, match="share one float dtype"):
        kernels.call(PAGED_ATTENTION, batch.query, batch.key_cache, batch.value_cache.half(), *batch.args()[3:], 0.1)
    with pytest.raises(TypeError, match="block_tables"):
        kernels.call(PAGED_ATTENTION, batch.query, batch.key_cache, batch.value_cache, batch.block_tables.float(),
                     batch.seq_lens, batch.query_start_loc, 0.1)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixtures are stateless factories
@given(
    seqs=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 12)), min_size=1, max_size=4),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4, 5]),
    head_size=st.sampled_from([64, 80, 96, 128]),
    block_size=st.sampled_from([8, 16, 32]),
    sliding_window=st.sampled_from([None, 7, 24]),
    num_kv_splits=st.sampled_from([1, 2]),
    dtype=st.sampled_from([F16, BF16, F32]),
)
def test_random_batches(run_both, paged_batch, assert_matches, seqs, num_kv_heads, group, head_size, block_size,
                        sliding_window, num_kv_splits, dtype):
    batch = paged_batch(seqs, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_size=head_size,
                        block_size=block_size, dtype=dtype)
    out, ref = run_both(batch, sliding_window=sliding_window, num_kv_splits=num_kv_splits)
    assert_matches(out, ref)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_int64_offsets_in_a_4_gib_pool(interpreter, tmp_path, assert_matches, num_kv_splits):
    """Block ids above 2^20 whose offsets pass 2^31 elements (see kernel_sparse_pool.py)."""
    out, ref = interpreter.call("kernel_sparse_pool:attention", str(tmp_path / "pool.bin"), num_kv_splits)
    assert_matches(out, ref)
