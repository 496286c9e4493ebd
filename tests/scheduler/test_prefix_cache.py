"""Prefix keys chain over every earlier token; lookups stop at the first miss."""

from __future__ import annotations

from pagedserve.scheduler.kv.block_pool import BlockPool
from pagedserve.scheduler.kv.prefix_cache import PrefixCache, hash_block
from pagedserve.scheduler.core.sequence import Sequence


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(seq_id=0, output_index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens))


def test_keys_chain_over_the_whole_prefix() -> None:
    first = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == first
    assert hash_block(first, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert len(first) == 16


def test_find_prefix_reuses_registered_blocks_in_order() -> None:
    pool = BlockPool(8, enable_caching=True)
    cache = PrefixCache(pool, block_size=2)
    owner = _seq([1, 2, 3, 4, 5, 6, 7])
    owner.block_table = [pool.allocate() for _ in range(4)]
    owner.num_computed_tokens = 7
    cache.register_computed(owner)
    assert owner.num_registered_blocks == 3  # the partial fourth block is never registered
    assert pool.lookup(owner.block_keys[2]) == owner.block_table[2]

    reader = _seq([1, 2, 3, 4, 9, 9, 9, 9])
    num_queries, blocks = cache.find_prefix(reader, len(reader.token_ids) - 1)
    assert num_queries == 3
    assert blocks == owner.block_table[:2]  # stops at the first differing block

    same = _seq([1, 2, 3, 4, 5, 6])
    num_queries, blocks = cache.find_prefix(same, len(same.token_ids) - 1)
    assert (num_queries, blocks) == (2, owner.block_table[:2])  # the last token is always recomputed


def test_disabled_cache_finds_nothing_and_registers_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    cache = PrefixCache(pool, block_size=2)
    seq = _seq([1, 2, 3, 4])
    seq.block_table = [pool.allocate(), pool.allocate()]
    seq.num_computed_tokens = 4
    cache.register_computed(seq)
    assert pool.key_map() == {}
    assert cache.find_prefix(_seq([1, 2, 3, 4, 5]), 4) == (0, [])
