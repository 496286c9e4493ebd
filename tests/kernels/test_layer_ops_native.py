"""The native fused layer kernels (kernels/native via layer_ops_native) against their torch
references (layer_ops_ref), the dispatch in ops.py, and the library's build."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.kernels.layer import native as layer_ops_native
from pagedserve.kernels.layer import reference as layer_ops_ref
from pagedserve.kernels.native import library as native_lib
from pagedserve.worker.layers.rotary import RopeConfig, RotaryEmbedding

HIDDEN, INNER = 576, 1536

pytestmark = pytest.mark.skipif(native_lib.compiler() is None, reason="needs a C compiler")


def _bf16(*shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).bfloat16()


def test_library_builds_and_shares_torchs_openmp_runtime():
    assert layer_ops_native.library() is not None
    maps = Path("/proc/self/maps").read_text()
    libraries = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line}
    assert len(libraries) == 1, libraries  # torch's copy only: one thread pool


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch_in_bfloat16(num_tokens, with_residual):
    x = _bf16(num_tokens, HIDDEN, seed=num_tokens) * 3
    weight = (_bf16(HIDDEN, seed=1) * 0.1 + 1).contiguous()
    residual = _bf16(num_tokens, HIDDEN, seed=2) if with_residual else None
    ours_residual = residual.clone() if with_residual else None
    ours = layer_ops_native.add_rms_norm(x, ours_residual, weight, 1e-5)
    expected = layer_ops_ref.add_rms_norm(x.clone(), residual, weight, 1e-5)
    if with_residual:
        assert torch.equal(ours_residual, residual)  # the add is exact
    # the float32 sum of squares may differ from torch's in its last bit, which flips a rare bfloat16 rounding
    assert (ours != expected).float().mean() < 1e-3
    assert torch.allclose(ours.float(), expected.float(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("num_tokens", [1, 33])
def test_silu_mul_matches_torch_in_bfloat16(num_tokens):
    gate_up = _bf16(num_tokens, 2 * INNER, seed=num_tokens) * 4
    ours = layer_ops_native.silu_mul(gate_up, INNER)
    expected = layer_ops_ref.silu_mul(gate_up.clone(), INNER)
    assert ours.shape == (num_tokens, INNER) and ours.is_contiguous()
    assert (ours != expected).float().mean() < 1e-3
    assert torch.allclose(ours.float(), expected.float(), rtol=1e-2, atol=1e-30)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_rotary_write_kv_equals_torch_bit_for_bit(dtype, cache_dtype, num_heads, num_kv_heads):
    head_size, num_tokens, block_size, num_blocks = 64, 11, 16, 6
    rotary = RotaryEmbedding(RopeConfig(head_size, theta=10000.0), 300, dtype=dtype, device="cpu")
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size).to(dtype)
    positions = torch.randint(0, 300, (num_tokens,))
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1  # padding: nothing written
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=cache_dtype)
              for _ in range(2)]
    expected_caches = [cache.clone() for cache in caches]
    ours, expected = qkv.clone(), qkv.clone()
    assert layer_ops_native.supports_rotary_write_kv(ours, rotary.cos_sin, caches[0])
    layer_ops_native.rotary_write_kv(ours, rotary.cos_sin, positions, slots, *caches, num_heads, num_kv_heads)
    layer_ops_ref.rotary_write_kv(expected, rotary.cos_sin, positions, slots, *expected_caches, num_heads,
                                  num_kv_heads)
    assert torch.equal(ours, expected)
    for cache, expected_cache in zip(caches, expected_caches):
        assert torch.equal(cache.isnan(), expected_cache.isnan())  # the same slots written, the padding skipped
        assert torch.equal(cache.nan_to_num(), expected_cache.nan_to_num())


def test_rotary_matches_the_models_own_rotation():
    rotary = RotaryEmbedding(RopeConfig(64), 64, dtype=torch.float32, device="cpu")
    qkv = torch.randn(3, 5 * 64)
    positions = torch.tensor([0, 7, 63])
    cos, sin = rotary.lookup(positions)
    expected = RotaryEmbedding.rotate(qkv[:, :4 * 64].view(3, 4, 64), cos, sin)
    caches = [torch.zeros(4, 16, 1, 64) for _ in range(2)]
    layer_ops_native.rotary_write_kv(qkv, rotary.cos_sin, positions, torch.tensor([0, 1, 2]), *caches, 3, 1)
    assert torch.equal(qkv[:, :4 * 64].view(3, 4, 64), expected)
    assert torch.equal(caches[0].view(-1, 64)[:3], expected[:, 3])
    assert torch.equal(caches[1].view(-1, 64)[:3], qkv[:, 4 * 64:])


def test_dispatch_keeps_torch_for_float32_and_under_reference(monkeypatch):
    x, weight = torch.randn(4, HIDDEN), torch.rand(HIDDEN) + 0.5
    assert not layer_ops_native.supports_rows(x, weight)  # float32 is the exact-equality dtype
    assert torch.equal(ops.add_rms_norm(x, None, weight, 1e-6), layer_ops_ref.add_rms_norm(x, None, weight, 1e-6))
    gate_up = torch.randn(2, 8).bfloat16()
    assert layer_ops_native.supports_silu_mul(gate_up)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "reference")
    assert native_lib.load() is None
    qkv = torch.randn(2, 6 * 64)
    assert not ops.rotary_write_kv(qkv.clone(), torch.randn(10, 128), torch.tensor([0, 1]), torch.tensor([0, 1]),
                                   torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64), 4, 1)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    assert native_lib.load() is None
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "auto")
    monkeypatch.setenv("PAGEDSERVE_NATIVE", "0")
    assert native_lib.load() is None
    assert not layer_ops_native.supports_silu_mul(gate_up)


def test_a_failing_compiler_is_an_error_not_a_library(tmp_path):
    with pytest.raises(native_lib.NativeBuildError, match="failed"):
        native_lib.build("false", tmp_path / "lib.so")
    assert not list(tmp_path.iterdir())  # no half-written file left


def test_a_process_without_a_compiler_runs_the_torch_paths(tmp_path):
    script = ("import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
              "from pagedserve.kernels import ops\nfrom pagedserve.kernels.native import library as native_lib\n"
              "assert native_lib.load() is None\n"
              "x = torch.randn(2, 8).bfloat16(); print(ops.silu_mul(x, 4).shape)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={"PATH": str(tmp_path), "PAGEDSERVE_CACHE": str(tmp_path / "cache"),
                                 "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "torch.Size([2, 4])" in result.stdout
    assert "native_kernels_unavailable" in result.stderr


def test_a_changed_source_builds_a_new_library(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    compiler = native_lib.compiler()
    first = native_lib.library_path(compiler)
    monkeypatch.setattr(native_lib, "CFLAGS", (*native_lib.CFLAGS, "-DPAGEDSERVE_TEST_VARIANT"))
    second = native_lib.library_path(compiler)
    assert first != second and first.parent.parent == second.parent.parent == tmp_path / "native"
    assert native_lib.build(compiler, second).exists()
    assert not [path for path in second.parent.iterdir() if path.name.startswith(".build-")]


def test_warning_names_the_reason(caplog, monkeypatch):
    monkeypatch.setattr(native_lib, "compiler", lambda: None)
    native_lib._load_cached.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert native_lib.load() is None
        assert "no C compiler" in caplog.text
    finally:
        native_lib._load_cached.cache_clear()
