"""Automatic prefix caching: full blocks are found again by a key chained over every token up
to the block's end.

    tokens  [ b0: t0 .. t15 ][ b1: t16 .. t31 ][ b2: t32 .. t47 ][ b3: partial ]
    keys      k0 = H(-, b0)    k1 = H(k0, b1)    k2 = H(k1, b2)     (none: not full)

H is BLAKE2b (16 bytes) over the parent key and the block's token ids, so equal keys mean equal
prefixes (no accidental or crafted collisions) and keys are stable across processes; it lives in
pagedserve/contracts/prefix_hash.py, which the frontend's replica router uses too. A block is
registered once its last token's KV is scheduled (steps run in order on the workers, so any later
step that reuses it reads finished KV). A new sequence reuses the longest run of registered
blocks that ends before its last token: that token is always computed again, so there are
logits to sample from. A sequence run with a LoRA adapter chains its keys from a root made of the
adapter's content digest (Sequence.key_root), so no KV is shared across adapters or versions.
"""

from __future__ import annotations

from pagedserve.contracts.prefix_hash import hash_block
from pagedserve.scheduler.kv.block_pool import BlockPool
from pagedserve.scheduler.core.sequence import Sequence

__all__ = ["PrefixCache", "hash_block"]


class PrefixCache:
    """Computes block keys for sequences, finds cached prefixes and counts queries and hits."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_queries = 0  # full prompt blocks looked up
        self.num_hits = 0  # of those, blocks reused
        self.on_registered = None  # (block, key) of each newly registered block (the KV tiers)

    @property
    def is_enabled(self) -> bool:
        return self.pool.is_caching_enabled

    def keys_of(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """seq.block_keys extended to at least num_blocks full blocks."""
        keys = seq.block_keys
        size = self.block_size
        tokens = seq.token_ids
        while len(keys) < num_blocks:
            index = len(keys)
            keys.append(hash_block(keys[-1] if keys else seq.key_root, tokens[index * size:(index + 1) * size]))
        return keys

    def find_prefix(self, seq: Sequence, max_num_tokens: int) -> tuple[int, list[int]]:
        """(blocks looked up, cached blocks) of the longest registered run within max_num_tokens.

        Nothing is acquired; the caller takes references only when it commits.
        """
        num_candidates = max_num_tokens // self.block_size
        if not self.is_enabled or num_candidates <= 0:
            return 0, []
        lookup = self.pool.lookup
        found: list[int] = []
        for key in self.keys_of(seq, num_candidates)[:num_candidates]:
            block = lookup(key)
            if block is None:
                break
            found.append(block)
        return num_candidates, found

    def record(self, num_queries: int, num_hits: int) -> None:
        self.num_queries += num_queries
        self.num_hits += num_hits

    def register_computed(self, seq: Sequence) -> None:
        """Registers seq's full blocks whose KV has been scheduled and that are not yet offered."""
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_registered_blocks
        if num_full <= start:
            return
        seq.num_registered_blocks = num_full
        if not self.is_enabled:
            return
        keys = self.keys_of(seq, num_full)
        register = self.pool.register
        table = seq.block_table
        on_registered = self.on_registered
        for index in range(start, num_full):
            if register(table[index], keys[index]) and on_registered is not None:
                on_registered(table[index], keys[index])
