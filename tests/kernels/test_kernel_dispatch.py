"""The kernel dispatcher: plain torch on CPU, Triton on CUDA, PAGEDSERVE_KERNELS overrides both."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from pagedserve.kernels import ops
from pagedserve.kernels.cache.reference import copy_blocks_ref, write_kv_cache_ref
from pagedserve.kernels.attention.sdpa import paged_attention_sdpa
from pagedserve.kernels.attention.reference import paged_attention_ref

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def small_batch(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(4, 8, 1, 64, generator=gen).to(device)  # [4, 8, 1, 64]
    value_cache = torch.randn(4, 8, 1, 64, generator=gen).to(device)
    query = torch.randn(3, 2, 64, generator=gen).to(device)  # [3, 2, 64]: one decode, one 2-token chunk
    block_tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=device)  # [2, 2]
    seq_lens = torch.tensor([11, 9], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc


@pytest.mark.parametrize(("choice", "on_cpu", "on_cuda"), [
    (None, False, True),
    ("auto", False, True),
    ("triton", True, True),
    ("reference", False, False),
])
def test_use_triton(monkeypatch, choice, on_cpu, on_cuda):
    if choice is None:
        monkeypatch.delenv(ops.KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(ops.KERNELS_ENV, choice)
    assert ops.use_triton(CPU) is on_cpu
    assert ops.use_triton(CUDA) is (on_cuda and ops.has_triton())


def test_unknown_choice_is_an_error(monkeypatch):
    monkeypatch.setenv(ops.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="auto, triton or reference"):
        ops.use_triton(CPU)


@pytest.fixture
def triton_spies(monkeypatch):
    """Stand-ins for the Triton modules that record which functions ops called (no triton import)."""
    calls: list[str] = []

    def spy(name, result=None):
        def record(*args, **kwargs):
            calls.append(name)
            return result
        return record

    attention = types.ModuleType("pagedserve.kernels.attention.triton_kernel")
    attention.paged_attention = spy("paged_attention", result="triton output")
    cache = types.ModuleType("pagedserve.kernels.cache.triton_kernel")
    for name in ("write_kv_cache", "copy_blocks", "swap_blocks"):
        setattr(cache, name, spy(name))
    monkeypatch.setitem(sys.modules, attention.__name__, attention)
    monkeypatch.setitem(sys.modules, cache.__name__, cache)
    return calls


def call_every_op(batch):
    query, key_cache, value_cache = batch[:3]
    out = ops.paged_attention(*batch, 0.125)
    ops.write_kv_cache(query[:, :1], query[:, :1], key_cache, value_cache, torch.tensor([0, -1, 5]))
    ops.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 1]]))
    ops.swap_blocks(key_cache, value_cache, torch.tensor([[2, 3]]))
    return out


def test_cpu_tensors_take_plain_torch_by_default(monkeypatch, triton_spies):
    monkeypatch.delenv(ops.KERNELS_ENV, raising=False)
    batch = small_batch()
    expected = paged_attention_sdpa(*batch, 0.125)
    reference = paged_attention_ref(*batch, 0.125)
    out = call_every_op(batch)
    assert triton_spies == []
    torch.testing.assert_close(out, reference)  # decodes by the native kernel, prefill chunks by SDPA
    monkeypatch.setenv("PAGEDSERVE_NATIVE", "0")  # no native library: the batched-SDPA path alone
    torch.testing.assert_close(ops.paged_attention(*small_batch(), 0.125), expected, atol=0, rtol=0)
    torch.testing.assert_close(batch[2][3], batch[1][2])  # swap_blocks moved key block 2 into value block 3


def test_switch_forces_the_reference(monkeypatch, triton_spies):
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    batch = small_batch()
    expected = paged_attention_ref(*batch, 0.125)
    torch.testing.assert_close(ops.paged_attention(*batch, 0.125), expected, atol=0, rtol=0)
    assert triton_spies == []


def test_switch_forces_triton_on_cpu(monkeypatch, triton_spies):
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    assert call_every_op(small_batch()) == "triton output"
    assert triton_spies == ["paged_attention", "write_kv_cache", "copy_blocks", "swap_blocks"]


def test_switch_runs_the_real_triton_path(kernels, device):
    """Through ops with PAGEDSERVE_KERNELS=triton: interpreted on CPU, compiled on CUDA."""
    env = {ops.KERNELS_ENV: "triton"}
    batch = small_batch(device)
    out = kernels.call("pagedserve.kernels.ops:paged_attention", *batch, 0.125, env=env)
    torch.testing.assert_close(out, paged_attention_ref(*batch, 0.125))
    query, key_cache, value_cache = batch[:3]
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    slots = torch.tensor([0, -1, 29], device=device)
    write_kv_cache_ref(query[:, :1], query[:, 1:], expected_key, expected_value, slots)
    copy_blocks_ref([expected_key], [expected_value], torch.tensor([[3, 0]], device=device))
    kernels.call("pagedserve.kernels.ops:write_kv_cache", query[:, :1], query[:, 1:], key_cache, value_cache, slots,
                 env=env)
    kernels.call("pagedserve.kernels.ops:copy_blocks", [key_cache], [value_cache],
                 torch.tensor([[3, 0]], device=device), env=env)
    torch.testing.assert_close(key_cache, expected_key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_value, atol=0, rtol=0)


def run_python(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", ops.KERNELS_ENV)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_ops_works_without_triton_installed():
    run_python("""
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        import torch
        from pagedserve.kernels import ops
        assert not ops.has_triton()
        assert not ops.use_triton(torch.device("cuda"))
        cache = torch.randn(2, 8, 1, 64)
        out = ops.paged_attention(torch.randn(1, 1, 64), cache, cache, torch.tensor([[1]], dtype=torch.int32),
                                  torch.tensor([5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.1)
        assert out.shape == (1, 1, 64) and not out.isnan().any()
        assert "triton" not in [name for name, module in sys.modules.items() if module is not None]
    """)


def test_kernels_refuse_cpu_tensors_without_the_interpreter():
    run_python("""
        import torch
        from pagedserve.kernels.attention import triton_kernel as paged_attention
        from pagedserve.kernels.cache import triton_kernel as cache_ops
        cache = torch.zeros(2, 8, 1, 64)
        for call in (
            lambda: paged_attention.paged_attention(torch.zeros(1, 1, 64), cache, cache,
                torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                torch.tensor([0, 1], dtype=torch.int32), 0.1),
            lambda: cache_ops.write_kv_cache(cache[0], cache[0], cache, cache, torch.zeros(8, dtype=torch.int64)),
        ):
            try:
                call()
            except RuntimeError as exc:
                assert "TRITON_INTERPRET=1" in str(exc), exc
            else:
                raise AssertionError("a Triton kernel accepted CPU tensors without the interpreter")
    """)


@pytest.mark.parametrize("few_rows", ["panels", "rows"])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 9])
def test_bound_linear_takes_the_kernel_linear_takes(monkeypatch, few_rows, num_rows):
    """ops.bound_linear writes what ops.linear returns, bit for bit, for the values x holds at each
    call, whichever kernel the host's tuning picks for the rows; None where linear has no kernel to bind."""
    from pagedserve.kernels.linear import native_rows, panels
    from pagedserve.kernels.native import tuning

    if panels.library() is None or native_rows.library() is None:
        pytest.skip("needs a C compiler and AVX-512 BF16")
    monkeypatch.setattr(tuning, "panels_for_few_rows", lambda lib: few_rows == "panels")
    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(70, 64, generator=generator).bfloat16()
    bias = torch.randn(70, generator=generator).bfloat16()
    packed = panels.pack(weight)
    x = torch.empty(num_rows, 64, dtype=torch.bfloat16)
    out = torch.empty(num_rows, 70, dtype=torch.bfloat16)
    call = ops.bound_linear(x, weight, bias, prepacked=packed, out=out)
    assert call is not None
    for _ in range(3):
        x.copy_(torch.randn(num_rows, 64, generator=generator))
        call()
        assert torch.equal(out, ops.linear(x, weight, bias, prepacked=packed))
    assert ops.bound_linear(x, weight, bias, out=out) is None  # F.linear
    assert ops.bound_linear(x.float(), weight, bias, prepacked=packed, out=out) is None
    assert ops.bound_linear(x, weight, bias, prepacked=packed, out=out[:, :5]) is None
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    assert ops.bound_greedy(out) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bound_greedy_gives_what_greedy_gives(dtype):
    from pagedserve.kernels.sampling import greedy as greedy_kernel

    logits = torch.empty(3, 1000, dtype=dtype)
    call = ops.bound_greedy(logits)
    if greedy_kernel.supports(logits) is None:
        assert call is None
        return
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        logits.copy_(torch.randn(3, 1000, generator=generator))
        assert call() == ops.greedy(logits)
