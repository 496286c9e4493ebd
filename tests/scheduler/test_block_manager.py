"""Block tables: slot allocation, copy-on-write after forks, exact block needs, swapping."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.scheduler.kv.block_manager import BlockManager
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import Sequence


def _manager(num_gpu_blocks: int = 32, num_cpu_blocks: int = 32, block_size: int = 4) -> BlockManager:
    return BlockManager(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                                        block_size=block_size, max_model_len=1024, max_num_seqs=8,
                                        max_num_batched_tokens=64))


def _seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id=seq_id, output_index=seq_id, token_ids=list(range(num_tokens)), num_prompt_tokens=num_tokens)


def _compute(manager: BlockManager, seq: Sequence, num_tokens: int, copies: list) -> None:
    manager.append_slots(seq, num_tokens, copies)
    seq.num_computed_tokens += num_tokens


def test_blocks_are_allocated_one_block_at_a_time() -> None:
    manager = _manager()
    seq = _seq(0, 20)
    copies: list = []
    _compute(manager, seq, 5, copies)
    assert len(seq.block_table) == 2
    _compute(manager, seq, 3, copies)
    assert len(seq.block_table) == 2  # slots 5..7 fit the second block
    _compute(manager, seq, 1, copies)
    assert len(seq.block_table) == 3
    assert copies == []
    assert manager.gpu_pool.num_used == 3


def test_copy_on_write_copies_a_shared_partial_block_once_per_extra_writer() -> None:
    manager = _manager()
    parent = _seq(0, 8)
    copies: list = []
    _compute(manager, parent, 6, copies)  # blocks [b0 full, b1 with 2 of 4 slots]
    children = [_seq(index, 8) for index in (1, 2)]
    for child in children:
        manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
    shared_full, shared_partial = parent.block_table
    assert manager.gpu_pool.ref_counts[shared_partial] == 3
    writers = [(parent, 1), *[(child, 1) for child in children]]
    assert manager.count_blocks_needed(writers, manager.gpu_pool) == 2
    for seq, num_tokens in writers:
        _compute(manager, seq, num_tokens, copies)
    assert [src for src, _ in copies] == [shared_partial, shared_partial]
    assert children[1].block_table[1] == shared_partial  # the last writer owns it in place
    assert {seq.block_table[0] for seq in (parent, *children)} == {shared_full}  # full blocks stay shared
    assert manager.gpu_pool.ref_counts[shared_full] == 3
    assert manager.gpu_pool.num_used == 4


def test_full_shared_last_block_needs_no_copy() -> None:
    manager = _manager()
    parent = _seq(0, 8)
    copies: list = []
    _compute(manager, parent, 4, copies)
    child = _seq(1, 8)
    manager.fork(parent, child)
    child.num_computed_tokens = 4
    assert manager.count_blocks_needed([(parent, 1), (child, 1)], manager.gpu_pool) == 2
    _compute(manager, parent, 1, copies)
    _compute(manager, child, 1, copies)
    assert copies == []
    assert parent.block_table[1] != child.block_table[1]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.integers(0, 3), st.integers(1, 9)), min_size=1, max_size=12))
def test_count_blocks_needed_is_exact(prefix_len: int, writes: list[tuple[int, int]]) -> None:
    manager = _manager(num_gpu_blocks=128)
    root = _seq(0, 64)
    copies: list = []
    _compute(manager, root, prefix_len, copies)
    seqs = [root]
    for seq_id in range(1, 4):
        child = _seq(seq_id, 64)
        manager.fork(root, child)
        child.num_computed_tokens = prefix_len
        seqs.append(child)
    chunks, seen = [], set()
    for index, num_tokens in writes:
        if index not in seen:  # one chunk per sequence per step
            seen.add(index)
            chunks.append((seqs[index], num_tokens))
    before = manager.gpu_pool.num_available
    predicted = manager.count_blocks_needed(chunks, manager.gpu_pool)
    for seq, num_tokens in chunks:
        _compute(manager, seq, num_tokens, copies)
    assert before - manager.gpu_pool.num_available == predicted


def test_swap_out_and_in_preserve_sharing() -> None:
    manager = _manager()
    copies: list = []
    parent = _seq(0, 12)
    _compute(manager, parent, 10, copies)
    child = _seq(1, 12)
    manager.fork(parent, child)
    child.num_computed_tokens = 10
    _compute(manager, child, 1, copies)  # child copies the partial third block
    gpu_tables = [list(parent.block_table), list(child.block_table)]
    num_distinct = manager.num_distinct_blocks([parent, child])
    assert num_distinct == 4
    assert manager.can_swap_out([parent, child])

    moves = manager.swap_out([parent, child])
    assert len(moves) == num_distinct  # each physical block moved once
    assert manager.gpu_pool.num_used == 0
    assert manager.cpu_pool.num_used == num_distinct
    cpu_of = dict(moves)
    assert [[cpu_of[block] for block in table] for table in gpu_tables] == [parent.block_table, child.block_table]
    assert manager.cpu_pool.ref_counts[parent.block_table[0]] == 2

    moves_in = manager.swap_in([parent, child])
    assert len(moves_in) == num_distinct
    assert manager.cpu_pool.num_used == 0
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != child.block_table[2]
    assert manager.gpu_pool.ref_counts[parent.block_table[0]] == 2


def test_swap_in_reuses_prefix_cached_copies() -> None:
    manager = _manager()
    seq = _seq(0, 12)
    copies: list = []
    _compute(manager, seq, 9, copies)
    manager.prefix_cache.register_computed(seq)  # two full blocks registered
    full_blocks = seq.block_table[:2]
    manager.swap_out([seq])
    assert manager.gpu_pool.num_cached == 2  # the GPU copies stay findable
    moves = manager.swap_in([seq])
    assert seq.block_table[:2] == full_blocks  # reused without copying
    assert len(moves) == 1


def test_swap_out_needs_room_on_the_cpu() -> None:
    manager = _manager(num_cpu_blocks=1)
    seq = _seq(0, 12)
    _compute(manager, seq, 6, [])
    assert not manager.can_swap_out([seq])


def test_free_releases_tail_first_for_lru() -> None:
    manager = _manager()
    seq = _seq(0, 12)
    _compute(manager, seq, 12, [])
    manager.prefix_cache.register_computed(seq)
    table = list(seq.block_table)
    manager.free(seq)
    assert seq.block_table == []
    assert manager.gpu_pool.cached_ids() == table[::-1]  # the tail is evicted first
