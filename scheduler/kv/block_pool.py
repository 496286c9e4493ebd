"""Fixed-size KV blocks of one device: reference counts, a free list and, on the GPU, the
least-recently-used set of cached blocks that the prefix cache can still hand out.

Every block is in exactly one state:

    state    ref_count   key        where
    free     0           None       free list
    used     > 0         any        referenced by block tables
    cached   0           not None   evictable LRU (oldest first); still findable by key

    num_free + num_used + num_cached == num_blocks

allocate() takes a free block first and evicts the least recently released cached block only
when the free list is empty. A key is a chained prefix hash (prefix_cache.py); the pool keeps the
key -> block map of registered full blocks, so eviction also forgets the key; `on_evict`, when
set, hears of each evicted keyed block first (the KV tiers keep its KV: scheduler/kv/tiers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedserve.scheduler.core.errors import NoFreeBlocks


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.is_caching_enabled = enable_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_of_key: dict[bytes, int] = {}
        self.num_used = 0
        self.on_evict: Callable[[int, bytes], None] | None = None  # (block, key) before it is reused

    # -- counts -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now: free plus evictable cached."""
        return len(self._free_ids) + len(self._evictable)

    # -- reference counting -----------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh block with ref_count 1 and no key."""
        if self._free_ids:
            block = self._free_ids.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            key = self.block_keys[block]
            self.block_keys[block] = None
            if key is not None and self._block_of_key.get(key) == block:
                del self._block_of_key[key]
                if self.on_evict is not None:
                    self.on_evict(block, key)
        else:
            raise NoFreeBlocks(f"all {self.num_blocks} blocks are referenced")
        self.ref_counts[block] = 1
        self.num_used += 1
        return block

    def acquire(self, block: int) -> None:
        """One more reference to a used block, or revives a cached one."""
        if self.ref_counts[block] == 0:
            if block not in self._evictable:
                raise NoFreeBlocks(f"block {block} is free, not cached: nothing to share")
            del self._evictable[block]
            self.num_used += 1
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """Drops one reference; at zero a keyed block becomes cached (most recent), others free."""
        count = self.ref_counts[block] - 1
        if count < 0:
            raise NoFreeBlocks(f"block {block} released more often than referenced")
        self.ref_counts[block] = count
        if count == 0:
            self.num_used -= 1
            if self.is_caching_enabled and self.block_keys[block] is not None:
                self._evictable[block] = None
            else:
                self.block_keys[block] = None
                self._free_ids.append(block)

    # -- keys -------------------------------------------------------------------------------
    def register(self, block: int, key: bytes) -> bool:
        """Makes a used, full block findable by key; False when another block already has it."""
        if not self.is_caching_enabled or key in self._block_of_key or self.block_keys[block] is not None:
            return False
        self.block_keys[block] = key
        self._block_of_key[key] = block
        return True

    def carry_key(self, block: int, key: bytes | None) -> None:
        """Remembers a key on a block without making it findable (CPU copies of cached blocks)."""
        self.block_keys[block] = key

    def lookup(self, key: bytes) -> int | None:
        return self._block_of_key.get(key)

    # -- inspection (tests, invariants) -----------------------------------------------------
    def free_ids(self) -> list[int]:
        return list(self._free_ids)

    def cached_ids(self) -> list[int]:
        return list(self._evictable)

    def key_map(self) -> dict[bytes, int]:
        return dict(self._block_of_key)

    def reset(self) -> None:
        """Forgets every block (workers restarted, KV lost)."""
        on_evict = self.on_evict
        self.__init__(self.num_blocks, enable_caching=self.is_caching_enabled)
        self.on_evict = on_evict
