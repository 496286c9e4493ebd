"""The CPU paged attention (batched SDPA) against the reference, on the pools of build_paged_batch:
unused slots and padded table entries hold NaN, so any read outside a context shows. Every case
also runs a second "layer" (other queries and cache values, the same tables and lengths) through
one plan built beforehand, as the layers of a step share it."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.kernels.attention import sdpa as sdpa_module
from pagedserve.kernels import ops
from pagedserve.kernels.attention.sdpa import paged_attention_sdpa, plan_sdpa_attention
from pagedserve.kernels.attention.reference import paged_attention_ref
from tests.kernels.conftest import build_paged_batch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def check(assert_matches):
    """Builds a CPU batch of (cached context, new tokens) sequences and compares both paths."""
    def run(seqs, *, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32,
            sliding_window=None, seed=0, **batch_options):
        batch = build_paged_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                                  block_size=block_size, dtype=dtype, device=torch.device("cpu"), seed=seed,
                                  **batch_options)
        scale = head_size ** -0.5
        expected = paged_attention_ref(*batch.args(), scale, sliding_window)
        actual = paged_attention_sdpa(*batch.args(), scale, sliding_window)
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert_matches(actual, expected)
        query, key_cache, value_cache, *layout = batch.args()
        plan = plan_sdpa_attention(*layout, block_size, sliding_window)
        for layer in range(2):
            args = (query * (1.0 - 2.5 * layer), key_cache * (1.0 + layer), value_cache - layer, *layout)
            expected = paged_attention_ref(*args, scale, sliding_window)
            assert_matches(paged_attention_sdpa(*args, scale, sliding_window, plan=plan), expected)
    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 2), (8, 1), (12, 4)])
def test_mixed_batch_over_gqa_ratios(dtype, num_heads, num_kv_heads, check):
    seqs = [(0, 17), (40, 1), (15, 1), (3, 9), (0, 1), (63, 1), (31, 33), (100, 1)]
    check(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_head_and_block_sizes(head_size, block_size, check):
    seqs = [(block_size - 1, 1), (block_size, 1), (2 * block_size - 1, 2), (0, block_size + 1),
            (block_size + 1, 1), (0, 1)]
    check(seqs, head_size=head_size, block_size=block_size)


@pytest.mark.parametrize("context", [1, 15, 16, 17, 31, 32, 33, 255, 256, 257])
def test_decode_lengths_at_block_boundaries(context, check):
    """A decode batch whose members end just before, at and after block boundaries."""
    seqs = [(context - 1, 1), (max(0, context - 2), 1), (context + 15, 1), (context + 16, 1)]
    seqs = [(ctx, q) for ctx, q in seqs if ctx + q > 0]
    check(seqs, block_size=16)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 40, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(sliding_window, dtype, check):
    seqs = [(0, 50), (30, 20), (70, 1), (5, 1), (16, 1), (47, 3), (0, 1)]
    check(seqs, num_heads=8, num_kv_heads=2, dtype=dtype, sliding_window=sliding_window)


def test_prefill_chunks_after_cached_prefixes(check):
    seqs = [(0, 64), (16, 48), (33, 7), (200, 2), (5, 100)]
    check(seqs, num_heads=8, num_kv_heads=2)


def test_many_decodes_split_into_chunks(monkeypatch, check):
    """More decodes than one gather chunk holds, in several length bands, with queries in an order
    unrelated to their lengths."""
    monkeypatch.setattr(sdpa_module, "DECODE_CHUNK_ROWS", 256)
    rng = random.Random(1)
    seqs = [(rng.randint(0, 300), 1) for _ in range(64)]
    seqs[10] = (0, 30)  # a prefill among them
    check(seqs, num_heads=12, num_kv_heads=4)


def test_a_context_longer_than_a_chunk(monkeypatch, check):
    monkeypatch.setattr(sdpa_module, "DECODE_CHUNK_ROWS", 64)
    check([(500, 1), (20, 1), (499, 1)])


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed, check):
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 3, 4])
    seqs = []
    for _ in range(rng.randint(1, 24)):
        q_len = rng.choice([1, 1, 1, rng.randint(1, 48)])
        seqs.append((rng.choice([0, rng.randint(0, 130)]), q_len))
    check(seqs, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, block_size=rng.choice([8, 16, 32]),
          dtype=rng.choice(DTYPES), sliding_window=rng.choice([None, rng.randint(1, 64)]), seed=seed)


def test_block_ids_above_2_16(check):
    check([(40, 1), (0, 20), (70, 1)], num_heads=2, num_kv_heads=1, block_size=8, num_blocks=66_000,
          min_block_id=65_600)


def test_sequences_without_new_tokens_are_skipped(check):
    check([(5, 0), (30, 1), (0, 4), (9, 0), (17, 1)])


def test_strided_query(assert_matches):
    """The model hands attention a query that is a view into the fused QKV projection."""
    batch = build_paged_batch([(30, 1), (0, 9), (12, 1)], num_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    qkv = torch.randn(batch.query.shape[0], 8 * 64)
    qkv[:, : 4 * 64] = batch.query.reshape(-1, 4 * 64)
    query = qkv[:, : 4 * 64].view(-1, 4, 64)  # [T, nh, hs], row stride 512
    args = (query, *batch.args()[1:])
    assert_matches(paged_attention_sdpa(*args, 0.125), paged_attention_ref(*args, 0.125))


@pytest.mark.parametrize("seqs", [[(64, 1)], [(40, 1), (40, 1), (40, 1)], [(40, 1), (30, 1), (17, 1)]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_in_order_in_one_chunk(seqs, dtype, check):
    """Decodes already sorted by length in one chunk: SDPA's output is returned as the result."""
    check(seqs, num_heads=9, num_kv_heads=3, dtype=dtype)
    batch = build_paged_batch(seqs, num_heads=9, num_kv_heads=3, head_size=64, block_size=16, dtype=dtype,
                              device=torch.device("cpu"))
    assert plan_sdpa_attention(*batch.args()[3:], 16).covers_all_rows


def test_step_plans_are_built_once_per_block_size_and_window(assert_matches):
    """ops.paged_attention keeps one plan per (block size, window) in the step's dict; a layer with
    another window gets its own."""
    batch = build_paged_batch([(30, 1), (0, 9), (12, 1)], num_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    step_plans: dict = {}
    for window in (None, None, 8, None, 8):
        actual = ops.paged_attention(*batch.args(), 0.125, window, step_plans=step_plans)
        assert_matches(actual, paged_attention_ref(*batch.args(), 0.125, window))
    plans = [key for key in step_plans if isinstance(key, tuple) and key[0] == "sdpa_attention"]
    assert sorted(key[2] or 0 for key in plans) == [0, 8]
    # with the native decode kernel, one decode list serves every window
    assert set(step_plans) - set(plans) <= {"native_rows"}
