"""Consistency checks of block accounting and queues, run by tests after every step.

    per pool     free + used + cached == total; the three sets are disjoint
                 ref_count == number of table entries (over all live sequences) naming the block
                 free: ref 0, no key; cached: ref 0, a key the pool maps back to it
    per group    waiting: no blocks; running: GPU tables; swapped: CPU tables
                 every table covers exactly its computed tokens
                 at least the last token is uncomputed between steps (it is computed and sampled next)
    per step     running sequences fit max_num_seqs
    KV tiers     host slots: each free or holding one key, pinned only while a fetch is pending;
                 disk index within its budget; no device block saved twice in one step's plan
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedserve.scheduler.kv.block_pool import BlockPool
from pagedserve.scheduler.core.errors import InvariantError
from pagedserve.scheduler.core.sequence import GroupStatus

if TYPE_CHECKING:
    from pagedserve.scheduler.core.scheduler import Scheduler


def check_pool(pool: BlockPool, references: Counter[int], name: str) -> None:
    free_ids = pool.free_ids()
    cached_ids = pool.cached_ids()
    free, cached = set(free_ids), set(cached_ids)
    if len(free) != len(free_ids) or len(cached) != len(cached_ids):
        raise InvariantError(f"{name}: a block is listed twice in the free or cached list")
    if free & cached:
        raise InvariantError(f"{name}: blocks {sorted(free & cached)[:5]} are both free and cached")
    used = {block for block in range(pool.num_blocks) if pool.ref_counts[block] > 0}
    if pool.num_used != len(used):
        raise InvariantError(f"{name}: num_used {pool.num_used} but {len(used)} blocks are referenced")
    if len(free) + len(used) + len(cached) != pool.num_blocks:
        raise InvariantError(f"{name}: free {len(free)} + used {len(used)} + cached {len(cached)} "
                             f"!= total {pool.num_blocks}")
    if used & (free | cached):
        raise InvariantError(f"{name}: referenced blocks {sorted(used & (free | cached))[:5]} are free or cached")
    for block in range(pool.num_blocks):
        if pool.ref_counts[block] != references.get(block, 0):
            raise InvariantError(f"{name}: block {block} has ref_count {pool.ref_counts[block]} but "
                                 f"{references.get(block, 0)} table entries")
    for block in free:
        if pool.block_keys[block] is not None:
            raise InvariantError(f"{name}: free block {block} still has a key")
    key_map = pool.key_map()
    for block in cached:
        key = pool.block_keys[block]
        if key is None or key_map.get(key) != block:
            raise InvariantError(f"{name}: cached block {block} is not findable by its key")
    for key, block in key_map.items():
        if pool.block_keys[block] != key:
            raise InvariantError(f"{name}: key map names block {block} whose key differs")


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    size = manager.block_size
    gpu_refs: Counter[int] = Counter()
    cpu_refs: Counter[int] = Counter()
    queues = ((GroupStatus.WAITING, scheduler.waiting), (GroupStatus.RUNNING, scheduler.running),
              (GroupStatus.SWAPPED, scheduler.swapped))
    num_groups = 0
    is_in_flight = scheduler.is_step_in_flight
    for status, queue in queues:
        keys = [group.queue_key for group in queue]
        if keys != sorted(keys):
            raise InvariantError(f"{status.value} queue is not in (priority, arrival) order")
        for group in queue:
            num_groups += 1
            if group.status is not status:
                raise InvariantError(f"request {group.request_id} is {group.status.value} in the {status.value} queue")
            if not group.seqs:
                raise InvariantError(f"request {group.request_id} has no live sequence but is queued")
            for seq in group.seqs:
                if seq.is_finished:
                    raise InvariantError(f"sequence {seq.seq_id} is finished but still live")
                if status is GroupStatus.WAITING and (seq.block_table or seq.num_computed_tokens):
                    raise InvariantError(f"waiting sequence {seq.seq_id} holds blocks")
                num_needed = -(-seq.num_computed_tokens // size)
                num_ahead = len(seq.block_table) - num_needed  # a block held ahead (continuable.py)
                if not 0 <= num_ahead <= 1 or (num_ahead and (len(group.seqs) > 1 or not seq.num_computed_tokens)):
                    raise InvariantError(f"sequence {seq.seq_id}: {len(seq.block_table)} blocks for "
                                         f"{seq.num_computed_tokens} computed tokens")
                if num_ahead and status is GroupStatus.RUNNING and manager.gpu_pool.ref_counts[seq.block_table[-1]] != 1:
                    raise InvariantError(f"sequence {seq.seq_id}: the block it holds ahead is shared")
                if seq.num_computed_tokens > len(seq.token_ids) - (0 if is_in_flight else 1):
                    raise InvariantError(f"sequence {seq.seq_id}: {seq.num_computed_tokens} of "
                                         f"{len(seq.token_ids)} tokens computed")
                (cpu_refs if status is GroupStatus.SWAPPED else gpu_refs).update(seq.block_table)
    if num_groups != len(scheduler._groups):
        raise InvariantError(f"{len(scheduler._groups)} requests known but {num_groups} queued")
    num_running_seqs = sum(group.max_num_running_seqs for group in scheduler.running)
    if num_running_seqs > scheduler.config.max_num_seqs:
        raise InvariantError(f"{num_running_seqs} running sequences exceed max_num_seqs")
    check_pool(manager.gpu_pool, gpu_refs, "gpu")
    check_pool(manager.cpu_pool, cpu_refs, "cpu")
    if manager.cpu_pool.num_cached:
        raise InvariantError("the CPU pool caches blocks")
    if manager.tiers is not None:
        check_tiers(manager.tiers)


def check_tiers(tiers) -> None:
    host, disk = tiers.host, tiers.disk
    if host is not None:
        try:
            host.check()
        except ValueError as exc:
            raise InvariantError(str(exc)) from None
        if host._pinned != set(host._pending.values()):
            raise InvariantError("host tier: slots stay pinned after their step's operations were taken")
    if disk is not None and len(disk) > disk.max_num_blocks:
        raise InvariantError(f"disk tier: {len(disk)} blocks over its budget of {disk.max_num_blocks}")
