"""A worker rank's memory budget (worker/memory_budget.py) and the host-memory defaults it uses
(pagedserve/host_memory.py): swap space none on a CPU device, 4 GiB on CUDA; explicit sizes that
leave the host nothing are refused; a draft model's weights and KV count."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pagedserve.host_memory import GIB, MIB, cpu_kv_pool_bytes, default_swap_space_gib, total_memory
from pagedserve.worker.memory_budget import MemoryBudgetError, plan_memory

BLOCK_BYTES = 32 * 1024


@dataclass
class _Shape:
    bytes_per_block: int = BLOCK_BYTES


class FakeRunner:
    """What plan_memory asks of a loaded ModelRunner (without a draft model)."""

    def __init__(self, num_weight_bytes: int, default_pool_bytes: int) -> None:
        self.num_weight_bytes = num_weight_bytes
        self.num_draft_weight_bytes = 0
        self.cache_shape = _Shape()
        self.draft_cache_shape = None
        self.bytes_per_block = BLOCK_BYTES
        self._default_pool_bytes = default_pool_bytes

    def profile_num_blocks(self, *, kv_cache_memory_gib: float | None = None) -> int:
        if kv_cache_memory_gib is not None:
            return int(kv_cache_memory_gib * GIB) // BLOCK_BYTES
        return self._default_pool_bytes // BLOCK_BYTES

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        return num_bytes // BLOCK_BYTES


def test_the_cpu_pool_is_a_capped_share_of_total_memory_after_the_weights():
    assert cpu_kv_pool_bytes(24 * GIB, 500 * MIB) == 2 * GIB  # a 24 GiB host: the cap
    assert cpu_kv_pool_bytes(8 * GIB, 2 * GIB) == int(6 * GIB * 0.1)
    assert cpu_kv_pool_bytes(2 * GIB, GIB) == 256 * MIB  # the floor
    assert cpu_kv_pool_bytes(64 * GIB, 0, num_ranks=4) == 2 * GIB // 4  # ranks share the host
    assert 0 < total_memory()


def test_swap_space_defaults_to_none_on_cpu_and_4_gib_on_cuda():
    assert default_swap_space_gib("cpu") == 0.0
    assert default_swap_space_gib("cuda") == 4.0


def test_the_default_cpu_budget_logs_weights_pool_swap_and_headroom():
    runner = FakeRunner(num_weight_bytes=GIB, default_pool_bytes=cpu_kv_pool_bytes(24 * GIB, GIB))
    budget = plan_memory(runner, device_type="cpu", num_ranks=1, kv_cache_memory_gib=None,
                         swap_space_gib=None, total_bytes=24 * GIB)
    assert (budget.num_swap_bytes, budget.num_cpu_blocks) == (0, 0)
    assert budget.num_kv_pool_bytes == 2 * GIB
    assert budget.num_headroom_bytes == 24 * GIB - GIB - 2 * GIB
    assert set(budget.log_fields()) >= {"num_weight_bytes", "num_kv_pool_bytes", "num_swap_bytes",
                                        "num_headroom_bytes", "num_host_bytes"}


def test_an_explicit_swap_space_still_works_on_cpu_and_cuda_keeps_4_gib():
    runner = FakeRunner(num_weight_bytes=GIB, default_pool_bytes=GIB)
    cpu = plan_memory(runner, device_type="cpu", num_ranks=1, kv_cache_memory_gib=None,
                      swap_space_gib=0.5, total_bytes=24 * GIB)
    assert cpu.num_swap_bytes == GIB // 2
    cuda = plan_memory(runner, device_type="cuda", num_ranks=2, kv_cache_memory_gib=None,
                       swap_space_gib=None, total_bytes=24 * GIB)
    assert cuda.num_swap_bytes == 4 * GIB
    assert cuda.num_headroom_bytes == 24 * GIB - 2 * 4 * GIB  # the pool and weights are on the GPU


@pytest.mark.parametrize("kv_gib, swap_gib, match", [(30.0, None, "KV pool 30.00 GiB"), (None, 24.0, "swap 24.00 GiB"),
                                                     (12.0, 12.0, "more than its 24.00 GiB")])
def test_explicit_sizes_that_leave_no_headroom_are_refused(kv_gib, swap_gib, match):
    runner = FakeRunner(num_weight_bytes=GIB, default_pool_bytes=GIB)
    with pytest.raises(MemoryBudgetError, match=match):
        plan_memory(runner, device_type="cpu", num_ranks=1, kv_cache_memory_gib=kv_gib,
                    swap_space_gib=swap_gib, total_bytes=24 * GIB)


def test_a_draft_model_counts_its_weights_and_its_kv_in_every_block(checkpoint_dir, tmp_path):
    from tiny_models import SIZES

    from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
    from pagedserve.worker.model_runner import ModelRunner

    target = checkpoint_dir("llama-gqa-untied")
    draft = build_tiny_checkpoint(tmp_path / "draft", **{**SIZES, "num_layers": 1}, seed=5)
    alone = ModelRunner(target, device="cpu", dtype="float32", block_size=16)
    paired = ModelRunner(target, device="cpu", dtype="float32", block_size=16, speculative_model=draft)
    alone.load()
    paired.load()
    assert paired.num_weight_bytes == alone.num_weight_bytes and paired.num_draft_weight_bytes > 0
    target_bytes = alone.cache_shape.bytes_per_block
    assert paired.bytes_per_block == target_bytes + target_bytes // 2  # 1 draft layer beside 2, the same heads
    budgets = [plan_memory(runner, device_type="cpu", num_ranks=1, kv_cache_memory_gib=0.01, swap_space_gib=0.02,
                           total_bytes=24 * GIB) for runner in (alone, paired)]
    assert budgets[1].num_gpu_blocks == int(0.01 * GIB) // paired.bytes_per_block < budgets[0].num_gpu_blocks
    assert budgets[1].num_cpu_blocks == int(0.02 * GIB) // paired.bytes_per_block
    assert budgets[1].num_draft_weight_bytes == paired.num_draft_weight_bytes
    assert budgets[0].num_headroom_bytes - budgets[1].num_headroom_bytes == pytest.approx(
        paired.num_draft_weight_bytes, abs=2 * paired.bytes_per_block)  # pool and swap keep their byte sizes
    assert budgets[1].log_fields()["num_draft_bytes_per_block"] == target_bytes // 2
    default = paired.profile_num_blocks()  # the CPU default: the host's share after both models' weights
    assert default * paired.bytes_per_block <= alone.profile_num_blocks() * target_bytes


def test_the_host_kv_tier_is_host_memory_and_counted():
    runner = FakeRunner(num_weight_bytes=GIB, default_pool_bytes=GIB)
    budget = plan_memory(runner, device_type="cpu", num_ranks=2, kv_cache_memory_gib=None, swap_space_gib=None,
                         total_bytes=24 * GIB, host_tier_gib=0.5)
    assert budget.num_host_blocks == GIB // 2 // BLOCK_BYTES
    assert budget.num_host_tier_bytes == GIB // 2
    assert budget.num_headroom_bytes == 24 * GIB - 2 * (GIB + GIB + GIB // 2)
    assert budget.log_fields()["num_host_tier_bytes"] == GIB // 2
    with pytest.raises(MemoryBudgetError, match="host KV tier 20.00 GiB"):
        plan_memory(runner, device_type="cuda", num_ranks=1, kv_cache_memory_gib=None, swap_space_gib=0,
                    total_bytes=16 * GIB, host_tier_gib=20.0)
