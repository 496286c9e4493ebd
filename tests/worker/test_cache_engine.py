"""Cache engine: block copy and swap round trips (the draft model's caches too), operation order,
sizing rules."""

from __future__ import annotations

import pytest
import torch

from pagedserve.host_memory import CPU_KV_MAX_BYTES, CPU_KV_MIN_BYTES
from pagedserve.worker.cache_engine import (
    GIB,
    CacheConfigError,
    CacheEngine,
    CacheShape,
    blocks_for_bytes,
    cpu_device_blocks,
    pair_bytes_per_block,
)

SHAPE = CacheShape(num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)


def _filled_engine(num_gpu_blocks: int = 10, num_cpu_blocks: int = 6) -> CacheEngine:
    engine = CacheEngine(SHAPE, num_gpu_blocks, num_cpu_blocks, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for key, value in engine.gpu_cache:
        key.copy_(torch.randn(key.shape, generator=generator))
        value.copy_(torch.randn(value.shape, generator=generator))
    return engine


def _block(engine: CacheEngine, block_id: int, on_cpu: bool = False) -> list[torch.Tensor]:
    caches = engine.cpu_cache if on_cpu else engine.gpu_cache
    return [tensor[block_id].clone() for layer in caches for tensor in layer]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_copy_duplicates_blocks_in_every_layer():
    engine = _filled_engine()
    before = {block: _block(engine, block) for block in range(10)}
    engine.copy([(2, 7), (3, 8)])
    assert _equal(_block(engine, 7), before[2]) and _equal(_block(engine, 8), before[3])
    assert _equal(_block(engine, 2), before[2]) and _equal(_block(engine, 0), before[0])


def test_swap_out_then_in_round_trip_preserves_contents():
    engine = _filled_engine()
    before = {block: _block(engine, block) for block in (1, 4, 9)}
    engine.swap_out([(1, 0), (4, 5), (9, 2)])
    assert _equal(_block(engine, 5, on_cpu=True), before[4])
    for key, value in engine.gpu_cache:  # the device blocks get reused by others meanwhile
        key[[1, 4, 9]] = 0.0
        value[[1, 4, 9]] = 0.0
    engine.swap_in([(0, 3), (5, 6), (2, 1)])
    assert _equal(_block(engine, 3), before[1])
    assert _equal(_block(engine, 6), before[4])
    assert _equal(_block(engine, 1), before[9])


def test_block_ops_run_swap_out_then_swap_in_then_copy():
    """A block swapped out and refilled by a swap-in in the same step keeps the swapped-in data."""
    engine = _filled_engine()
    original = {block: _block(engine, block) for block in (2, 5)}
    engine.swap_out([(5, 0)])
    engine.execute_block_ops(swap_out=[(2, 1)], swap_in=[(0, 2)], copy=[(2, 8)])
    assert _equal(_block(engine, 1, on_cpu=True), original[2])
    assert _equal(_block(engine, 2), original[5])
    assert _equal(_block(engine, 8), original[5])


def test_out_of_range_block_ids_are_rejected():
    engine = _filled_engine()
    with pytest.raises(CacheConfigError, match="outside"):
        engine.copy([(0, 10)])
    with pytest.raises(CacheConfigError, match="outside"):
        engine.swap_out([(0, 6)])


def test_sizing_rules():
    assert SHAPE.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 4
    assert blocks_for_bytes(SHAPE.bytes_per_block * 5 + 1, SHAPE) == 5
    # 10 % of the host's total memory after the weights, within [256 MiB, 2 GiB], split between ranks
    assert cpu_device_blocks(SHAPE, 4 * GIB, total_bytes=24 * GIB) == 2 * GIB // SHAPE.bytes_per_block
    assert cpu_device_blocks(SHAPE, 0, total_bytes=1000 * GIB) == CPU_KV_MAX_BYTES // SHAPE.bytes_per_block
    assert cpu_device_blocks(SHAPE, 0, total_bytes=1 * GIB) == CPU_KV_MIN_BYTES // SHAPE.bytes_per_block
    assert cpu_device_blocks(SHAPE, GIB, total_bytes=11 * GIB) == GIB // SHAPE.bytes_per_block
    assert cpu_device_blocks(SHAPE, GIB, num_ranks=2, total_bytes=12 * GIB) == GIB // 2 // SHAPE.bytes_per_block
    with pytest.raises(CacheConfigError):
        CacheShape(num_layers=0, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)


FP8_SHAPE = CacheShape(num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_blocks_survive_swap_and_copy_on_write_bit_for_bit(dtype):
    shape = CacheShape(num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=dtype)
    engine = CacheEngine(shape, 10, 6, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for key, value in engine.gpu_cache:
        assert key.dtype == dtype
        key.copy_((torch.randn(key.shape, generator=generator) * 30).to(dtype))
        value.copy_((torch.randn(value.shape, generator=generator) / 30).to(dtype))
    raw = {block: [t.view(torch.uint8) for t in _block(engine, block)] for block in (1, 4, 9)}
    engine.copy([(4, 7)])  # copy-on-write of a shared last block
    assert _equal([t.view(torch.uint8) for t in _block(engine, 7)], raw[4])
    engine.swap_out([(1, 0), (9, 2)])
    for key, value in engine.gpu_cache:
        key[[1, 9]] = torch.zeros((), dtype=dtype)
        value[[1, 9]] = torch.zeros((), dtype=dtype)
    engine.swap_in([(0, 3), (2, 5)])
    assert _equal([t.view(torch.uint8) for t in _block(engine, 3)], raw[1])
    assert _equal([t.view(torch.uint8) for t in _block(engine, 5)], raw[9])


def test_narrower_kv_dtypes_hold_proportionally_more_blocks():
    budget = 64 * SHAPE.bytes_per_block  # 64 float32 blocks
    blocks = {dtype: blocks_for_bytes(budget, CacheShape(3, 4, 2, 8, dtype))
              for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)}
    assert blocks == {torch.float32: 64, torch.bfloat16: 128, torch.float16: 128, torch.float8_e4m3fn: 256,
                      torch.float8_e5m2: 256}
    assert FP8_SHAPE.bytes_per_block * 4 == SHAPE.bytes_per_block


DRAFT_SHAPE = CacheShape(num_layers=1, block_size=4, num_kv_heads=1, head_size=4, dtype=torch.float32)


def _filled_engine_with_draft() -> CacheEngine:
    engine = CacheEngine(SHAPE, 10, 6, torch.device("cpu"), draft_shape=DRAFT_SHAPE)
    generator = torch.Generator().manual_seed(1)
    for key, value in engine.gpu_cache + engine.draft_gpu_cache:
        key.copy_(torch.randn(key.shape, generator=generator))
        value.copy_(torch.randn(value.shape, generator=generator))
    return engine


def _draft_block(engine: CacheEngine, block_id: int, on_cpu: bool = False) -> list[torch.Tensor]:
    caches = engine.draft_cpu_cache if on_cpu else engine.draft_gpu_cache
    return [tensor[block_id].clone() for layer in caches for tensor in layer]


def test_the_draft_caches_share_block_ids_and_follow_copies_and_swaps():
    engine = _filled_engine_with_draft()
    assert [key.shape for key, _ in engine.draft_gpu_cache] == [torch.Size([10, 4, 1, 4])]
    assert [key.shape for key, _ in engine.draft_cpu_cache] == [torch.Size([6, 4, 1, 4])]
    target = {block: _block(engine, block) for block in range(10)}
    draft = {block: _draft_block(engine, block) for block in range(10)}
    engine.copy([(2, 7)])
    assert _equal(_draft_block(engine, 7), draft[2]) and _equal(_block(engine, 7), target[2])
    engine.swap_out([(4, 0), (9, 5)])
    assert _equal(_draft_block(engine, 5, on_cpu=True), draft[9])
    for key, value in engine.gpu_cache + engine.draft_gpu_cache:  # the device blocks get reused
        key[[4, 9]] = 0.0
        value[[4, 9]] = 0.0
    engine.swap_in([(0, 1), (5, 3)])
    assert _equal(_draft_block(engine, 1), draft[4]) and _equal(_block(engine, 1), target[4])
    assert _equal(_draft_block(engine, 3), draft[9]) and _equal(_block(engine, 3), target[9])


def test_a_block_with_a_draft_part_costs_both_models_bytes():
    pair = SHAPE.bytes_per_block + DRAFT_SHAPE.bytes_per_block
    assert pair_bytes_per_block(SHAPE, DRAFT_SHAPE) == pair == CacheEngine(SHAPE, 2, 0, torch.device("cpu"),
                                                                           draft_shape=DRAFT_SHAPE).bytes_per_block
    assert blocks_for_bytes(pair * 5 + 1, SHAPE, DRAFT_SHAPE) == 5
    assert blocks_for_bytes(pair * 20, SHAPE) == 21  # the target alone: more blocks in the same bytes
    assert cpu_device_blocks(SHAPE, 4 * GIB, total_bytes=24 * GIB, draft=DRAFT_SHAPE) == 2 * GIB // pair
    with pytest.raises(CacheConfigError, match="block size"):
        CacheEngine(SHAPE, 2, 0, torch.device("cpu"),
                    draft_shape=CacheShape(num_layers=1, block_size=8, num_kv_heads=1, head_size=4, dtype=torch.float32))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_cpu_pool_reads_as_zeros_and_takes_memory_only_for_blocks_written():
    shape = CacheShape(num_layers=2, block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    num_blocks = 8192  # 2 layers x K and V x 16 MiB
    before = _resident_bytes()
    engine = CacheEngine(shape, num_blocks, 0, torch.device("cpu"))
    assert _resident_bytes() - before < 8 << 20  # of a 64 MiB pool
    key, value = engine.gpu_cache[1]
    assert not key.any() and not value[num_blocks - 1].any()
    key[3].fill_(1.5)
    engine.copy([(3, 4)])
    assert torch.equal(key[4], key[3]) and not key[5].any() and not engine.gpu_cache[0][0][4].any()
    assert _resident_bytes() - before < 40 << 20  # the reads above map shared zero pages
