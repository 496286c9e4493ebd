"""BlockPool: reference counts, free list, LRU eviction of cached blocks, key registration."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.scheduler.kv.block_pool import BlockPool
from pagedserve.scheduler.core.errors import NoFreeBlocks


def _accounting(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_used, pool.num_cached


def test_allocate_release_without_caching() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = [pool.allocate() for _ in range(3)]
    assert blocks == [0, 1, 2]
    assert _accounting(pool) == (0, 3, 0)
    with pytest.raises(NoFreeBlocks):
        pool.allocate()
    pool.acquire(1)
    pool.release(1)
    assert pool.ref_counts[1] == 1
    pool.release(1)
    assert _accounting(pool) == (1, 2, 0)
    assert pool.allocate() == 1
    pool.release(2)
    with pytest.raises(NoFreeBlocks):
        pool.release(2)


def test_keyed_block_is_cached_then_revived() -> None:
    pool = BlockPool(2, enable_caching=True)
    block = pool.allocate()
    assert pool.register(block, b"k")
    pool.release(block)
    assert _accounting(pool) == (1, 0, 1)
    assert pool.lookup(b"k") == block
    pool.acquire(block)
    assert _accounting(pool) == (1, 1, 0)
    assert pool.ref_counts[block] == 1


def test_free_blocks_are_used_before_evicting_and_eviction_is_lru() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, c = (pool.allocate() for _ in range(3))
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(block, key)
    pool.release(b)
    pool.release(a)  # released after b: more recently used
    pool.release(c)
    pool.acquire(b)  # revived: leaves the LRU
    pool.release(b)  # now the most recent
    assert pool.cached_ids() == [a, c, b]
    assert pool.allocate() == a  # least recently released goes first
    assert pool.lookup(b"a") is None
    assert pool.lookup(b"c") == c
    assert pool.block_keys[a] is None


def test_register_refuses_duplicates_and_rekeying() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, b"x")
    assert not pool.register(b, b"x")  # another block holds the key
    assert not pool.register(a, b"y")  # a block keeps its first key
    pool.release(b)
    assert pool.num_free == 2  # unkeyed block goes straight back to the free list


def test_caching_disabled_pool_never_caches() -> None:
    pool = BlockPool(2, enable_caching=False)
    block = pool.allocate()
    assert not pool.register(block, b"k")
    pool.carry_key(block, b"k")
    pool.release(block)
    assert pool.num_cached == 0
    assert pool.block_keys[block] is None


def test_acquire_of_free_block_raises() -> None:
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(NoFreeBlocks):
        pool.acquire(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "acquire", "release", "register"]),
                          st.integers(0, 7)), max_size=80))
def test_random_operations_keep_accounting(operations: list[tuple[str, int]]) -> None:
    pool = BlockPool(6, enable_caching=True)
    held: list[int] = []
    for name, value in operations:
        if name == "alloc" and pool.num_available:
            held.append(pool.allocate())
        elif name == "acquire" and held:
            block = held[value % len(held)]
            pool.acquire(block)
            held.append(block)
        elif name == "release" and held:
            pool.release(held.pop(value % len(held)))
        elif name == "register" and held:
            pool.register(held[value % len(held)], bytes([value]))
        assert pool.num_free + pool.num_used + pool.num_cached == pool.num_blocks
        assert pool.num_used == len(set(held))
        for block in set(held):
            assert pool.ref_counts[block] == held.count(block)
        for block in pool.cached_ids():
            assert pool.ref_counts[block] == 0 and pool.lookup(pool.block_keys[block]) == block
