"""Block tables of sequences over the GPU and CPU pools: slot allocation with copy-on-write,
forking (and when a group's followers fork), freeing, prefix reuse and swapping.

Copy-on-write: forked sequences share every block, including a partly filled last one. The
first sequence that writes into a shared partial block gets a private copy:

    before   seq A: [ 7 | 9 ]   seq B: [ 7 | 9 ]     block 9 ref 2, holds 10 of 16 slots
    A writes slot 10 of block 9 -> allocate 12, copy 9 -> 12 (blocks_to_copy), A: [ 7 | 12 ]
    B writes slot 10 of block 9 -> ref now 1: B writes in place

Full blocks are never written again, so they stay shared (and prefix-cached) forever.

Forking a group (sequence.py): its leader computes the shared prefix [0, fork_at) alone; once it
has, every follower takes a copy of the leader's table and its progress:

    fork_at 6, block_size 4   leader [ 7 | 9 ] computed 6   follower [ ] computed 0
    fork_if_ready             leader [ 7 | 9 ]              follower [ 7 | 9 ] computed 6
                              (block 7 ref 2, block 9 ref 2 holding 2 of 4 slots: copy-on-write)
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.scheduler.kv.block_pool import BlockPool
from pagedserve.scheduler.kv.prefix_cache import PrefixCache
from pagedserve.scheduler.kv.tiers.kv_tiers import KvTiers
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup


class BlockManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.gpu_pool = BlockPool(config.num_gpu_blocks, enable_caching=config.enable_prefix_caching)
        self.cpu_pool = BlockPool(config.num_cpu_blocks, enable_caching=False)
        self.prefix_cache = PrefixCache(self.gpu_pool, config.block_size)
        self.tiers: KvTiers | None = None
        if config.enable_prefix_caching and config.has_kv_tiers:
            self.tiers = KvTiers(num_host_blocks=config.num_host_blocks, disk_folder=config.kv_layout_folder,
                                 max_disk_blocks=config.max_disk_blocks, world_size=config.num_kv_ranks,
                                 num_block_bytes=config.num_kv_block_bytes * config.num_kv_ranks,
                                 load_tokens_per_block=config.tier_load_tokens_per_block)
            self.gpu_pool.on_evict = self.tiers.on_device_evict
            self.prefix_cache.on_registered = self.tiers.on_registered

    # -- sizing -----------------------------------------------------------------------------
    def count_blocks_needed(self, chunks: Iterable[tuple[Sequence, int]], pool: BlockPool) -> int:
        """Exact blocks that append_slots takes for these (sequence, new tokens), in this order.

        c sequences writing into one shared partial block with r references copy it c times
        when r > c, and c - 1 times when r == c (the last writer is then its only owner).
        """
        size = self.block_size
        refs = pool.ref_counts
        num_needed = 0
        writers: dict[int, int] = {}
        for seq, num_new_tokens in chunks:
            table = seq.block_table
            computed = seq.num_computed_tokens
            if computed % size and refs[partial := table[computed // size]] > 1:
                writers[partial] = writers.get(partial, 0) + 1
            num_needed += max(0, -(-(computed + num_new_tokens) // size) - len(table))
        for block, num_writers in writers.items():
            num_needed += num_writers if refs[block] > num_writers else num_writers - 1
        return num_needed

    # -- GPU table operations ---------------------------------------------------------------
    def append_slots(self, seq: Sequence, num_new_tokens: int, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Makes seq's table cover num_computed_tokens + num_new_tokens slots on the GPU (the block
        its next slot is in, when shared, copied first; a table may hold a block ahead of that one:
        scheduler/core/continuable.py)."""
        pool = self.gpu_pool
        size = self.block_size
        table = seq.block_table
        computed = seq.num_computed_tokens
        if computed % size:
            index = computed // size
            partial = table[index]
            if pool.ref_counts[partial] > 1:
                copy = pool.allocate()
                blocks_to_copy.append((partial, copy))
                pool.release(partial)
                table[index] = copy
        num_missing = -(-(computed + num_new_tokens) // size) - len(table)
        for _ in range(num_missing):
            table.append(pool.allocate())

    # -- forking ----------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every GPU block of parent (its own table is replaced)."""
        acquire = self.gpu_pool.acquire
        for block in parent.block_table:
            acquire(block)
        child.block_table = list(parent.block_table)

    def fork_if_ready(self, group: SequenceGroup) -> None:
        """Followers share the leader's blocks once it has computed the common prefix."""
        leader = group.seqs[0]
        if group.fork_at is None or leader.num_computed_tokens < group.fork_at:
            return
        num_shared_keys = group.fork_at // self.block_size
        for follower in group.seqs[1:]:
            self.fork(leader, follower)
            follower.num_computed_tokens = leader.num_computed_tokens
            follower.num_registered_blocks = leader.num_registered_blocks
            follower.num_draft_computed = leader.num_draft_computed
            if len(follower.block_keys) < num_shared_keys:
                follower.block_keys = leader.block_keys[:num_shared_keys]
        group.fork_at = None

    def hand_over_before_fork(self, group: SequenceGroup, seq: Sequence) -> None:
        """seq is about to leave a group that has not forked yet: when it is the leader, the next
        sequence (the same tokens up to fork_at) takes over its table and progress."""
        if group.fork_at is None or seq is not group.seqs[0] or len(group.seqs) < 2:
            return
        successor = group.seqs[1]
        successor.block_table, seq.block_table = seq.block_table, []
        successor.num_computed_tokens = seq.num_computed_tokens
        successor.num_registered_blocks = seq.num_registered_blocks
        successor.num_draft_computed = seq.num_draft_computed

    # -- prefix reuse and freeing -----------------------------------------------------------
    def adopt_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Starts an empty sequence on cached blocks: their tokens count as computed (their
        draft-model KV does not: the blocks may never have held any)."""
        acquire = self.gpu_pool.acquire
        for block in blocks:
            acquire(block)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_registered_blocks = len(blocks)
        seq.num_draft_computed = 0

    def adopt_tier_hits(self, seq: Sequence, hits: list[tuple[bytes, int]]) -> None:
        """Extends seq's cached prefix with blocks from the host tier: each gets a device block,
        registered under its key and filled by a load before the step's forward. The caller
        pinned the hits' slots (no eviction of this step may reuse them) and checked room."""
        pool, tiers = self.gpu_pool, self.tiers
        for key, slot in hits:
            block = pool.allocate()
            pool.register(block, key)
            tiers.load(slot, block, key)
            seq.block_table.append(block)
        seq.num_computed_tokens += len(hits) * self.block_size
        seq.num_registered_blocks += len(hits)

    def truncate(self, seq: Sequence) -> None:
        """Releases the GPU blocks past seq's computed tokens (slots of rejected speculative
        tokens; the sequence wrote them in this step, so it owns them alone)."""
        table = seq.block_table
        num_kept = -(-seq.num_computed_tokens // self.block_size)
        release = self.gpu_pool.release
        while len(table) > num_kept:
            release(table.pop())

    def free(self, seq: Sequence, *, on_cpu: bool = False) -> None:
        """Releases seq's table, last block first so a request's tail is evicted before its head."""
        release = (self.cpu_pool if on_cpu else self.gpu_pool).release
        for block in reversed(seq.block_table):
            release(block)
        seq.block_table = []

    def drop_kv(self, group: SequenceGroup) -> None:
        """Frees every GPU block of the group; its sequences compute their tokens again later
        (a shared prefix once, then forked again)."""
        for seq in group.seqs:
            self.free(seq)
            seq.reset_computation()
        group.plan_shared_prefix()

    # -- swapping ---------------------------------------------------------------------------
    def num_distinct_blocks(self, seqs: Iterable[Sequence]) -> int:
        return len({block for seq in seqs for block in seq.block_table})

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return self.num_distinct_blocks(seqs) <= self.cpu_pool.num_available

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Moves the tables to CPU blocks, each physical block once: [(gpu, cpu)]."""
        gpu, cpu = self.gpu_pool, self.cpu_pool
        cpu_of: dict[int, int] = {}
        gpu_tables: list[list[int]] = []
        for seq in seqs:
            cpu_table: list[int] = []
            for block in seq.block_table:
                target = cpu_of.get(block)
                if target is None:
                    target = cpu.allocate()
                    cpu.carry_key(target, gpu.block_keys[block])
                    cpu_of[block] = target
                else:
                    cpu.acquire(target)
                cpu_table.append(target)
            gpu_tables.append(seq.block_table)
            seq.block_table = cpu_table
        for table in gpu_tables:
            for block in reversed(table):
                gpu.release(block)
        return list(cpu_of.items())

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Moves the tables back to GPU blocks, reusing prefix-cached copies: [(cpu, gpu)]."""
        gpu, cpu = self.gpu_pool, self.cpu_pool
        gpu_of: dict[int, int] = {}
        moves: list[tuple[int, int]] = []
        for seq in seqs:
            table = seq.block_table
            for index, block in enumerate(table):
                target = gpu_of.get(block)
                if target is None:
                    key = cpu.block_keys[block]
                    target = gpu.lookup(key) if key is not None else None
                    if target is not None:
                        gpu.acquire(target)
                    else:
                        target = gpu.allocate()
                        if key is not None:
                            gpu.register(target, key)
                        moves.append((block, target))
                    gpu_of[block] = target
                else:
                    gpu.acquire(target)
                table[index] = target
                cpu.release(block)
        return moves
