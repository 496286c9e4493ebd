"""The worker's KV tiers on a tiny model: blocks saved to host slots and block files come back
bit for bit, a restarted worker reads the files, and a truncated, corrupt or foreign file is
refused (reported, removed) instead of being loaded."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.contracts.prefix_hash import full_block_keys
from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan
from pagedserve.contracts.tier_ops import TierOps, TierSave, block_file_name, layout_dir
from pagedserve.worker.kv_tiers import block_file
from pagedserve.worker.model_runner import ModelRunner

BLOCK = 4
PROMPT = [5 + (index * 37) % 400 for index in range(13)]  # 3 full blocks and one token


def _runner(path, **options) -> ModelRunner:
    runner = ModelRunner(path, dtype=options.pop("dtype", "float32"), block_size=BLOCK, **options)
    runner.load()
    return runner


def _prefill(runner: ModelRunner, step_id: int = 1, tier_ops: TierOps | None = None) -> int:
    seq = ScheduledSeq(0, list(PROMPT), 0, [0, 1, 2, 3], SampleSpec())
    result = runner.execute(StepPlan(step_id=step_id, seqs=[seq], tier_ops=tier_ops))
    return result.samples[0].token_id


def _blocks(runner: ModelRunner, blocks: list[int]) -> list[torch.Tensor]:
    """The blocks' raw bytes (fp8 tensors compare as bytes)."""
    return [tensor[blocks].view(torch.uint8).clone() for pair in runner.cache.gpu_cache for tensor in pair]


@pytest.fixture()
def model_path(checkpoint_dir):
    return checkpoint_dir("llama-gqa-untied")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_host_and_disk_round_trip_and_restart(model_path, tmp_path, kv_cache_dtype) -> None:
    keys = full_block_keys(PROMPT, BLOCK)
    runner = _runner(model_path, kv_cache_dtype=kv_cache_dtype)
    runner.init_cache(8, 0, num_host_blocks=4, kv_cache_dir=str(tmp_path))
    first_token = _prefill(runner)
    expected = _blocks(runner, [0, 1, 2])
    saves = [TierSave(block, block, keys[block], to_disk=True) for block in range(3)]
    runner.execute(StepPlan(step_id=2, tier_ops=TierOps(saves=saves)))
    runner.tiers.writer.flush()
    # the device blocks are overwritten, then loaded back from the host slots into other blocks
    for pair in runner.cache.gpu_cache:
        for tensor in pair:
            tensor.view(torch.uint8).fill_(0x7F)
    runner.execute(StepPlan(step_id=3, tier_ops=TierOps(loads=[(0, 5), (1, 6), (2, 7)])))
    assert all(torch.equal(a, b) for a, b in zip(_blocks(runner, [5, 6, 7]), expected))
    folder = layout_dir(tmp_path, runner.kv_layout().layout_id)
    assert sorted(os.listdir(folder)) == sorted(block_file_name(key, 0) for key in keys)

    restarted = _runner(model_path, kv_cache_dtype=kv_cache_dtype)
    restarted.init_cache(8, 0, num_host_blocks=4, kv_cache_dir=str(tmp_path))
    fetch = TierOps(fetches=[(key, slot) for slot, key in enumerate(keys)])
    assert restarted.execute(StepPlan(step_id=1, tier_ops=fetch)).failed_fetch_keys == []
    restarted.execute(StepPlan(step_id=2, tier_ops=TierOps(loads=[(0, 0), (1, 1), (2, 2)])))
    assert all(torch.equal(a, b) for a, b in zip(_blocks(restarted, [0, 1, 2]), expected))
    # the last token computed on the loaded prefix samples what the cold prefill sampled
    tail = ScheduledSeq(0, PROMPT[12:], 12, [0, 1, 2, 3], SampleSpec())
    assert restarted.execute(StepPlan(step_id=3, seqs=[tail])).samples[0].token_id == first_token


def test_bad_block_files_are_reported_and_removed(model_path, tmp_path) -> None:
    keys = full_block_keys(PROMPT, BLOCK)
    runner = _runner(model_path)
    runner.init_cache(8, 0, num_host_blocks=4, kv_cache_dir=str(tmp_path))
    _prefill(runner)
    saves = [TierSave(block, -1, keys[block], to_disk=True) for block in range(3)]
    runner.execute(StepPlan(step_id=2, tier_ops=TierOps(saves=saves)))
    runner.tiers.writer.flush()
    folder = layout_dir(tmp_path, runner.kv_layout().layout_id)
    paths = [os.path.join(folder, block_file_name(key, 0)) for key in keys]
    with open(paths[0], "r+b") as file:  # truncated
        file.truncate(os.path.getsize(paths[0]) - 7)
    with open(paths[1], "r+b") as file:  # one payload byte flipped
        file.seek(-3, os.SEEK_END)
        byte = file.read(1)
        file.seek(-3, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0xFF]))
    host_before = [tensor[0].clone() for pair in runner.tiers.host for tensor in pair]
    result = runner.execute(StepPlan(step_id=3, tier_ops=TierOps(fetches=[(keys[0], 0), (keys[1], 1), (keys[2], 2)])))
    assert result.failed_fetch_keys == [keys[0], keys[1]]
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[1]) and os.path.exists(paths[2])
    assert all(torch.equal(a, tensor[0]) for a, tensor in
               zip(host_before, [tensor for pair in runner.tiers.host for tensor in pair]))
    # a file under another key's name (or from another layout) is refused by its header
    os.replace(paths[2], paths[0])
    result = runner.execute(StepPlan(step_id=4, tier_ops=TierOps(fetches=[(keys[0], 0)])))
    assert result.failed_fetch_keys == [keys[0]]


def test_another_dtype_or_block_size_has_another_layout(model_path) -> None:
    base = _runner(model_path).kv_layout().layout_id
    assert _runner(model_path, dtype="bfloat16").kv_layout().layout_id != base
    other_block = ModelRunner(model_path, dtype="float32", block_size=8)
    other_block.load()
    assert other_block.kv_layout().layout_id != base
    assert _runner(model_path, kv_cache_dtype="fp8_e4m3").kv_layout().layout_id != base
    assert _runner(model_path).kv_layout().layout_id == base


def test_block_file_decode_checks_everything() -> None:
    payload = bytes(range(200))
    data = block_file.encode(payload, key=b"k" * 16, rank=0, layout_id="L", layout={})
    assert block_file.decode(data, key=b"k" * 16, rank=0, layout_id="L", payload_bytes=200) == payload
    for bad, options in ((data[:-1], {}), (data, {"layout_id": "M"}), (data, {"rank": 1}),
                         (data, {"key": b"j" * 16}), (b"junk" + data, {}), (data[:10], {})):
        arguments = dict(key=b"k" * 16, rank=0, layout_id="L", payload_bytes=200) | options
        with pytest.raises(block_file.BadBlockFile):
            block_file.decode(bad, **arguments)


def test_worker_config_sizes_the_host_tier() -> None:
    from pagedserve.config.flags import ConfigError
    from pagedserve.worker.config import DISK_STAGING_GIB, WorkerConfig

    assert WorkerConfig(model_path="m").host_tier_gib == 0.0
    assert WorkerConfig(model_path="m", kv_cache_dir="/tmp/kv").host_tier_gib == DISK_STAGING_GIB
    assert WorkerConfig(model_path="m", kv_offloading_size_gib=2.0).host_tier_gib == 2.0
    with pytest.raises(ConfigError, match="staged in the host tier"):
        WorkerConfig(model_path="m", kv_cache_dir="/tmp/kv", kv_offloading_size_gib=0.0)
