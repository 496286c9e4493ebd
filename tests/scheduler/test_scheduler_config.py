"""SchedulerConfig validation raises real exceptions naming the field."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.core.errors import SchedulerConfigError
from pagedserve.scheduler.core.config import SchedulerConfig


def test_defaults() -> None:
    config = SchedulerConfig(num_gpu_blocks=10, max_model_len=64)
    assert (config.block_size, config.num_cpu_blocks, config.max_num_seqs) == (16, 0, 256)
    assert config.max_num_batched_tokens == 2048
    assert config.enable_prefix_caching is True
    assert config.preemption_mode == "auto"
    assert config.num_blocks_for(0) == 0
    assert config.num_blocks_for(16) == 1
    assert config.num_blocks_for(17) == 2


@pytest.mark.parametrize(("overrides", "field_name"), [
    ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
    ({"num_gpu_blocks": 2.0}, "num_gpu_blocks"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"num_cpu_blocks": -1}, "num_cpu_blocks"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "max_num_batched_tokens"),
    ({"preemption_mode": "both"}, "preemption_mode"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
    ({"swap_seconds_per_block": -1.0}, "swap_seconds_per_block"),
    ({"recompute_seconds_per_token": float("nan")}, "recompute_seconds_per_token"),
])
def test_invalid_fields_raise(overrides: dict, field_name: str) -> None:
    arguments = {"num_gpu_blocks": 10, "max_model_len": 64} | overrides
    with pytest.raises(SchedulerConfigError) as raised:
        SchedulerConfig(**arguments)
    assert raised.value.field_name == field_name
    assert isinstance(raised.value, ValueError)


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        SchedulerConfig(10, 64)  # type: ignore[misc]
