"""What `serve` refuses before starting anything (pagedserve/launch/serve_preflight.py): tensor-parallel
splits the workers cannot make, a context longer than the model's, explicit memory sizes the host
cannot hold."""

from __future__ import annotations

import pytest

from pagedserve.host_memory import GIB
from pagedserve.checkpoints.model_config import model_info_from_dict
from pagedserve.launch.serve_preflight import Deployment, PreflightError, block_bytes, check_deployment


def _model(num_heads: int = 8, num_kv_heads: int = 2, intermediate_size: int = 256, **extra):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 8 * num_heads,
              "num_hidden_layers": 2, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
              "intermediate_size": intermediate_size, "max_position_embeddings": 1024, **extra}
    return model_info_from_dict(config)


def _cpu(**fields) -> Deployment:
    return Deployment(device="cpu", **fields)


@pytest.mark.parametrize("num_heads, num_kv_heads, num_ranks", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8),
                                                                (8, 8, 4), (9, 3, 3), (9, 9, 1), (12, 3, 6)])
def test_splits_the_workers_can_make_pass(num_heads, num_kv_heads, num_ranks):
    """(12, 3, 6): fewer KV heads than ranks, each replicated on two ranks."""
    check_deployment(_model(num_heads, num_kv_heads, intermediate_size=72), _cpu(tensor_parallel_size=num_ranks),
                     total_bytes=64 * GIB)


def test_heads_not_divisible_by_the_ranks_are_named_with_the_sizes_that_work():
    with pytest.raises(PreflightError) as raised:
        check_deployment(_model(9, 9, intermediate_size=72), _cpu(tensor_parallel_size=2), total_bytes=64 * GIB)
    message = str(raised.value)
    assert "num_attention_heads (9) is not divisible by --tensor-parallel-size 2" in message
    assert "num_key_value_heads (9)" in message
    assert "sizes that work for this model: 1, 3, 9" in message


@pytest.mark.parametrize("num_heads, num_kv_heads, num_ranks, intermediate_size, match", [
    (12, 3, 4, 240, "not a multiple of num_key_value_heads"),
    (12, 6, 4, 240, "num_key_value_heads \\(6\\) is not divisible"),
    (8, 2, 2, 255, "intermediate_size \\(255\\)"),
])
def test_kv_heads_and_mlp_width_must_split_too(num_heads, num_kv_heads, num_ranks, intermediate_size, match):
    with pytest.raises(PreflightError, match=match):
        check_deployment(_model(num_heads, num_kv_heads, intermediate_size), _cpu(tensor_parallel_size=num_ranks),
                         total_bytes=64 * GIB)


def test_a_max_model_len_beyond_the_model_is_refused():
    check_deployment(_model(), _cpu(max_model_len=1024), total_bytes=64 * GIB)
    with pytest.raises(PreflightError, match="--max-model-len 4096 is more than the model's "
                                             "max_position_embeddings \\(1024\\)"):
        check_deployment(_model(), _cpu(max_model_len=4096), total_bytes=64 * GIB)


def test_explicit_memory_sizes_must_fit_the_host():
    model = _model()
    check_deployment(model, _cpu(kv_cache_memory_gib=4.0, swap_space_gib=2.0), total_bytes=24 * GIB)
    with pytest.raises(PreflightError, match="--kv-cache-memory does not fit this host: KV pool 30.00 GiB"):
        check_deployment(model, _cpu(kv_cache_memory_gib=30.0), total_bytes=24 * GIB)
    with pytest.raises(PreflightError, match="KV pool 16.00 GiB .* for 2 rank"):
        check_deployment(model, _cpu(kv_cache_memory_gib=8.0, swap_space_gib=4.0, tensor_parallel_size=2),
                         total_bytes=24 * GIB)
    with pytest.raises(PreflightError, match="--swap-space does not fit"):
        check_deployment(model, _cpu(swap_space_gib=24.0), total_bytes=24 * GIB)
    too_many_blocks = 24 * GIB // block_bytes(model, _cpu()) + 1
    with pytest.raises(PreflightError, match="--num-kv-blocks does not fit"):
        check_deployment(model, _cpu(num_kv_blocks=too_many_blocks), total_bytes=24 * GIB)


def test_on_cuda_only_the_swap_space_is_host_memory():
    model = _model()
    check_deployment(model, Deployment(device="cuda", kv_cache_memory_gib=60.0), total_bytes=24 * GIB)
    with pytest.raises(PreflightError, match="swap space 32.00 GiB"):
        check_deployment(model, Deployment(device="cuda", swap_space_gib=16.0, tensor_parallel_size=2),
                         total_bytes=24 * GIB)


def test_the_host_kv_tier_counts_as_host_memory():
    model = _model()
    check_deployment(model, _cpu(kv_offloading_size_gib=2.0), total_bytes=24 * GIB)
    with pytest.raises(PreflightError, match="--kv-offloading-size does not fit.*host KV tier 24.00 GiB"):
        check_deployment(model, _cpu(kv_offloading_size_gib=24.0), total_bytes=24 * GIB)
    with pytest.raises(PreflightError, match="host KV tier 32.00 GiB"):
        check_deployment(model, Deployment(device="cuda", kv_offloading_size_gib=16.0, tensor_parallel_size=2),
                         total_bytes=24 * GIB)
