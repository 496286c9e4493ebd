"""Preemption: when a running group needs blocks the GPU pool lacks, which group gives way, which
way it leaves the GPU, and the act itself.

Victim: the newest running group (the running queue is ordered by arrival, oldest first), and
the group that asked for the blocks itself once no newer one is left, so the oldest requests keep
running (first come, first served). Under --scheduling-policy priority every queue is ordered by
(priority, arrival), so the victim is the lowest-priority, newest group; there a waiting or
swapped group also preempts running groups of strictly lower priority (never equal ones) before
the step is built. step_builder.py preempts victims until the blocks fit.

    swap       move the group's blocks to the CPU pool (each physical block once), back later
    recompute  free the blocks, keep the tokens, prefill them again later

preemption_mode="swap" and "recompute" force one way; "swap" falls back to recompute when the CPU
pool cannot take the group. preemption_mode="auto" compares two estimates:

    swap cost      = distinct blocks of the group        * swap_seconds_per_block (out and back in)
    recompute cost = tokens the group would compute again * recompute_seconds_per_token

and swaps only when swapping is strictly cheaper and the CPU pool has room. Tokens computed again
count the group's shared prefix once (it is recomputed once and forked, see sequence.py) and
leave out full blocks that other requests also hold: those stay on the GPU and come back through
the prefix cache. Short sequences, whose last block is mostly empty, therefore lean to recompute.

The act: a swapped group joins the swapped queue with its tables on the CPU (its blocks move in
the step's blocks_to_swap_out); a recomputed one joins the waiting queue with no blocks. Both
queues stay in (priority, arrival) order, so a preempted group comes back before newer ones of
its priority.
"""

from __future__ import annotations

import enum
from bisect import insort
from typing import TYPE_CHECKING

from pagedserve.scheduler.kv.block_pool import BlockPool
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import GroupStatus, Sequence, SequenceGroup

if TYPE_CHECKING:
    from pagedserve.scheduler.core.scheduler import Scheduler


class PreemptionMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


def num_tokens_to_recompute(seqs: list[Sequence], pool: BlockPool, block_size: int) -> int:
    """KV slots the group holds alone: what recomputing it would redo."""
    slots_of: dict[int, int] = {}
    refs_in_group: dict[int, int] = {}
    for seq in seqs:
        computed = seq.num_computed_tokens
        for index, block in enumerate(seq.block_table):
            slots_of[block] = max(slots_of.get(block, 0), min(block_size, computed - index * block_size))
            refs_in_group[block] = refs_in_group.get(block, 0) + 1
    return sum(slots for block, slots in slots_of.items() if pool.ref_counts[block] <= refs_in_group[block])


def choose_preemption_mode(config: SchedulerConfig, *, num_blocks: int, num_recompute_tokens: int,
                           can_swap: bool) -> PreemptionMode:
    if not can_swap or config.preemption_mode == "recompute":
        return PreemptionMode.RECOMPUTE
    if config.preemption_mode == "swap":
        return PreemptionMode.SWAP
    swap_cost = num_blocks * config.swap_seconds_per_block
    recompute_cost = num_recompute_tokens * config.recompute_seconds_per_token
    return PreemptionMode.SWAP if swap_cost < recompute_cost else PreemptionMode.RECOMPUTE


def choose_victim(running: list[SequenceGroup]) -> SequenceGroup:
    """The running group to preempt next: the last in (priority, arrival) order, the newest."""
    return running[-1]


def preempt(scheduler: Scheduler, group: SequenceGroup,
            blocks_to_swap_out: list[tuple[int, int]]) -> PreemptionMode:
    """Takes a running group off the GPU, by swapping or recomputation; returns which. Either
    way its sequences compute their draft-model KV again (from position 0) when they next draft."""
    manager = scheduler.block_manager
    for seq in group.seqs:
        seq.num_draft_computed = 0
    scheduler.running.remove(group)
    mode = choose_preemption_mode(
        scheduler.config, num_blocks=manager.num_distinct_blocks(group.seqs),
        num_recompute_tokens=num_tokens_to_recompute(group.seqs, manager.gpu_pool, manager.block_size),
        can_swap=manager.can_swap_out(group.seqs))
    if mode is PreemptionMode.SWAP:
        blocks_to_swap_out.extend(manager.swap_out(group.seqs))
        group.status = GroupStatus.SWAPPED
        insort(scheduler.swapped, group, key=_arrival)
        scheduler.num_preemptions_swap += 1
    else:
        manager.drop_kv(group)
        group.status = GroupStatus.WAITING
        insort(scheduler.waiting, group, key=_arrival)
        scheduler.num_preemptions_recompute += 1
    return mode


def _arrival(group: SequenceGroup) -> tuple[int, int]:
    return group.queue_key
