"""GGUF blocks kept as the file has them (kernels/linear/block_quant.py): decoded exactly as the gguf
package decodes them, and multiplied by the native kernel (kernels/native/block_quant_rows.c) at 1..32
rows within float32 rounding of the exact result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedserve.cpu_features import has_native_bfloat16
from pagedserve.kernels import ops
from pagedserve.kernels.native import tuning
from pagedserve.kernels.linear import block_quant
from pagedserve.kernels.linear.block_quant import BlockQuantWeight
from pagedserve.kernels.native import abi
from pagedserve.worker.loading.gguf_weights import quantized_weight_of
from pagedserve.worker.quantization.gguf_blocks import GGUFBlocks

TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _gguf_weight(tensor_type: str, num_rows: int, num_cols: int, seed: int) -> tuple[BlockQuantWeight, np.ndarray]:
    """A weight quantized by the gguf package, kept as blocks, and the package's own decoding."""
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((num_rows, num_cols)) * 0.05 + rng.standard_normal((num_rows, 1)) * 0.02)
    raw = quantize(dense.astype(np.float32), GGMLQuantizationType[tensor_type])  # uint8 [rows, bytes]
    blocks = GGUFBlocks(tensor_type, (num_rows, num_cols), raw)
    return quantized_weight_of(blocks).to_packed(), dequantize(raw, GGMLQuantizationType[tensor_type])


@pytest.mark.parametrize("tensor_type", TYPES)
def test_kept_blocks_decode_as_the_gguf_package_does(tensor_type):
    weight, expected = _gguf_weight(tensor_type, 48, 160, seed=1)
    assert weight.scales.dtype == torch.float16 and weight.bits == (8 if tensor_type == "Q8_0" else 4)
    assert torch.equal(weight.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))


def _relative_to_exact(actual: torch.Tensor, x: torch.Tensor, weight: BlockQuantWeight) -> float:
    exact = F.linear(x.double(), weight.dequantize().double())
    return float((actual.double() - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 17, 32])
def test_native_rows_match_the_exact_product(tensor_type, num_rows):
    weight, _ = _gguf_weight(tensor_type, 200, 576, seed=num_rows)
    lib = _rows_lib(weight, num_rows)
    x = torch.randn(num_rows, 576, generator=torch.Generator().manual_seed(num_rows))
    bias = torch.randn(200)
    native = block_quant.block_quant_linear_native(x, weight, bias, lib)
    reference = block_quant.block_quant_linear_ref(x, weight, bias)
    assert native.dtype == torch.float32 and native.shape == (num_rows, 200)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
    assert _relative_to_exact(native - bias, x, weight) < 1e-6  # only the order of float32 sums differs
    bf16 = ops.block_quant_linear(x.bfloat16(), weight)  # without the BF16 variant: native up to EXACT_ROWS
    assert bf16.dtype == torch.bfloat16
    # the float32 results round to bfloat16 alike but where they straddle a rounding boundary
    torch.testing.assert_close(bf16, block_quant.block_quant_linear_ref(x.bfloat16(), weight), rtol=2 ** -7,
                               atol=1e-5)


def test_dispatch_takes_the_kernel_up_to_32_rows_and_the_exact_dequantize_above(monkeypatch):
    weight, _ = _gguf_weight("Q4_1", 64, 128, seed=9)
    for num_rows in (1, 32, 33, 100):
        x = torch.randn(num_rows, 128)
        y = ops.quantized_linear(x, weight)
        assert _relative_to_exact(y, x, weight) < 1e-6, num_rows
    assert block_quant.supports(torch.empty(33, 128), weight) is None
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    x = torch.randn(3, 128)
    assert torch.equal(ops.quantized_linear(x, weight), block_quant.block_quant_linear_ref(x, weight))


def test_bfloat16_rows_take_the_decoded_panels_up_to_the_hosts_tuned_rows(monkeypatch):
    """Above the kernel's 32 rows, bfloat16 activations (a prompt's prefill) multiply the blocks
    through the decoded panels up to the rows the host's tuning chose (kernels/native/tuning.py
    block_panel_rows), the dequantized weight and torch's matmul above; both are the product with
    the weights decoded to bfloat16, up to the order of float32 sums; float32 keeps 32 rows."""
    weight, _ = _gguf_weight("Q4_1", 70, 352, seed=13)
    lib = _bf16_lib(weight, 1)
    monkeypatch.setitem(lib._pagedserve_tuning, "block_quant_panel_rows", 64)
    dense = weight.dequantize(torch.bfloat16).double()
    taken = []
    native = block_quant.block_quant_linear_native
    monkeypatch.setattr(block_quant, "block_quant_linear_native",
                        lambda *args, **kwargs: taken.append(args[0].shape[0]) or native(*args, **kwargs))
    for num_rows in (33, 64, 65, 150):
        x = torch.randn(num_rows, 352, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
        y = ops.block_quant_linear(x, weight)
        expected = F.linear(x.double(), dense)
        assert y.dtype == torch.bfloat16
        assert float((y.double() - expected).abs().max() / expected.abs().max()) < 2 ** -7, num_rows
        out = torch.empty_like(y)
        call = ops.bound_block_quant_linear(x, weight, out=out)
        assert (call is not None) == (num_rows <= 64)
        if call is not None:
            call()
            assert torch.equal(out, y)
    assert taken == [33, 64]
    assert block_quant.supports(torch.empty(40, 352), weight) is None  # float32 activations: 32 rows


def test_weights_that_are_not_the_files_float16_are_refused():
    codes = torch.randint(0, 16, (16, 64))
    scales = torch.full((16, 2), 0.1)  # not a float16 value
    with pytest.raises(ValueError, match="float16"):
        BlockQuantWeight.from_codes(codes, scales, torch.zeros(16, 2), 4)
    with pytest.raises(ValueError, match="mins"):
        BlockQuantWeight(torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.float16), None, 4)


def _bf16_rows(lib, weight, x: torch.Tensor) -> torch.Tensor:
    """The BF16 kernel's float32 output (before the final rounding) for x bfloat16 [M, K]."""
    y = torch.empty(x.shape[0], weight.out_features)
    lib.block_quant_rows_bf16(x.data_ptr(), weight.qs.data_ptr(), weight.scales.data_ptr(),
                              weight.mins.data_ptr() if weight.mins is not None else None, y.data_ptr(), x.shape[0],
                              weight.out_features, weight.in_features, weight.bits)
    return y


def _rows_lib(weight, num_rows: int):
    lib = block_quant.supports(torch.empty(min(num_rows, block_quant.MAX_ROWS), weight.in_features), weight)
    if lib is None:
        pytest.fail("the native block kernel is unavailable on this CPU (it needs AVX-512, or AVX2 with FMA and F16C)")
    return lib


def _bf16_lib(weight, num_rows: int):
    lib = _rows_lib(weight, num_rows)
    if not block_quant._has_bf16(lib):
        if not has_native_bfloat16():
            pytest.skip("the BF16 block kernel needs AVX-512 BF16, which this CPU has not "
                        "(test_native_header.py builds it for such a CPU)")
        pytest.fail("the native bfloat16 block kernel is unavailable on a CPU with native bfloat16")
    return lib


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 32])
# groups: 10 (runs of 4, then a pair), 11 (then one more), 3 (a pair and one), 5 (a run and one), 16
@pytest.mark.parametrize("in_features", [320, 352, 96, 160, 512])
def test_bfloat16_rows_match_their_weights_product_before_rounding(tensor_type, num_rows, in_features):
    """On bfloat16 activations, up to EXACT_ROWS rows the BF16 variant multiplies the exact weights
    (the codes, exact in bfloat16, scaled per group in float32); from there on the weights decoded
    to bfloat16 as the file dequantized to bfloat16 has them. Its float32 output, read before the
    final rounding, is the product with those weights up to the order of float32 sums."""
    weight, _ = _gguf_weight(tensor_type, 96, in_features, seed=20 + num_rows)
    lib = _bf16_lib(weight, num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
    y = _bf16_rows(lib, weight, x)
    exact_weights = num_rows <= block_quant.EXACT_ROWS
    dense = weight.dequantize(torch.float32) if exact_weights else weight.dequantize(torch.bfloat16)
    expected = F.linear(x.double(), dense.double())
    assert float((y.double() - expected).abs().max() / expected.abs().max()) < 1e-6
    other = weight.dequantize(torch.bfloat16 if exact_weights else torch.float32).double()
    assert float((F.linear(x.double(), other) - expected).abs().max() / expected.abs().max()) > 1e-5  # tells them apart
    assert torch.equal(block_quant.block_quant_linear_native(x, weight, None, lib), y.to(torch.bfloat16))


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("num_rows", [9, 17, 32, 45, 100])
# one panel, a block of three panels and a partial one, 1.5 blocks, three blocks and one column
@pytest.mark.parametrize("out_features", [16, 37, 70, 145])
def test_decoded_panels_cover_every_output_column(tensor_type, num_rows, out_features):
    """Above EXACT_ROWS the weights are decoded in column blocks of up to three panels of 16 rows:
    every output column, the last partial panel's included, is the product with the weights decoded
    to bfloat16 up to the order of float32 sums, and nothing is written past the last column."""
    weight, _ = _gguf_weight(tensor_type, out_features, 352, seed=40 + out_features)
    lib = _bf16_lib(weight, num_rows)
    x = torch.randn(num_rows, 352, generator=torch.Generator().manual_seed(out_features)).bfloat16()
    y = torch.full((num_rows + 1, out_features), 7.0)  # a row past the output, to see no stray write
    lib.block_quant_rows_bf16(x.data_ptr(), weight.qs.data_ptr(), weight.scales.data_ptr(),
                              weight.mins.data_ptr() if weight.mins is not None else None, y.data_ptr(), num_rows,
                              out_features, 352, weight.bits)
    expected = F.linear(x.double(), weight.dequantize(torch.bfloat16).double())
    assert float((y[:num_rows].double() - expected).abs().max() / expected.abs().max()) < 1e-6
    assert torch.equal(y[num_rows], torch.full((out_features,), 7.0))


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("num_rows", [9, 20, 32])
def test_decoded_rows_do_not_depend_on_the_other_rows_of_the_batch(tensor_type, num_rows):
    """Above EXACT_ROWS each activation row's sums are taken in the same order whatever rows come
    with it (its block of eight, or alone at 9 rows): a sequence's tokens do not depend on the batch."""
    weight, _ = _gguf_weight(tensor_type, 70, 352, seed=60 + num_rows)
    lib = _bf16_lib(weight, num_rows)
    x = torch.randn(num_rows, 352, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
    y = _bf16_rows(lib, weight, x)
    shuffled = torch.roll(x, 3, dims=0)
    assert torch.equal(_bf16_rows(lib, weight, shuffled), torch.roll(y, 3, dims=0))


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("num_rows", [2, 5, 8])
def test_exact_rows_do_not_depend_on_the_other_rows_of_the_batch(tensor_type, num_rows):
    """Up to EXACT_ROWS rows each activation row's sums are taken in the same order whatever rows
    come with it: a batch gives each row what it gets alone, bit for bit."""
    weight, _ = _gguf_weight(tensor_type, 70, 576, seed=40 + num_rows)
    lib = _bf16_lib(weight, num_rows)
    x = torch.randn(num_rows, 576, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
    alone = torch.cat([_bf16_rows(lib, weight, x[i:i + 1].contiguous()) for i in range(num_rows)])
    assert torch.equal(_bf16_rows(lib, weight, x), alone)


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dequantize_gives_the_torch_values_bit_for_bit(tensor_type, dtype):
    """Above 32 rows the weight is dequantized for one matmul: natively in one pass, to the values
    BlockQuantWeight.dequantize computes (float32, or those rounded to bfloat16)."""
    weight, _ = _gguf_weight(tensor_type, 75, 320, seed=60)
    lib = _bf16_lib(weight, 1) if dtype == torch.bfloat16 else _rows_lib(weight, 1)
    out = torch.full((75, 320), float("nan"), dtype=dtype)
    assert lib.block_quant_dequantize(weight.qs.data_ptr(), weight.scales.data_ptr(),
                                      weight.mins.data_ptr() if weight.mins is not None else None, out.data_ptr(),
                                      75, 320, weight.bits, abi.DTYPE_CODES[dtype]) == 1
    assert torch.equal(out, weight.dequantize(torch.float32).to(dtype))
    assert torch.equal(block_quant.dequantize(weight, dtype), out)


@pytest.mark.parametrize("num_rows", [1, 3])
def test_the_code_prefetch_changes_no_result(num_rows):
    """The 4-bit kernel's prefetch distance (tuned per host) moves loads earlier, nothing else."""
    weight, _ = _gguf_weight("Q4_1", 300, 576, seed=60 + num_rows)
    lib = _bf16_lib(weight, num_rows)
    x = torch.randn(num_rows, 576, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
    before = lib.block_quant_prefetch()
    try:
        results = []
        for distance in (0, 64, 4096, 1 << 20):
            lib.block_quant_set_prefetch(distance)
            assert lib.block_quant_prefetch() == distance
            results.append(_bf16_rows(lib, weight, x))
        lib.block_quant_set_prefetch(-5)
        assert lib.block_quant_prefetch() == 0
    finally:
        lib.block_quant_set_prefetch(before)
    assert all(torch.equal(result, results[0]) for result in results[1:])


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_result_does_not_depend_on_the_thread_count(tensor_type, dtype):
    """Each output row is computed by one thread over all its groups (block_quant_rows.c): the same
    bits at 1 to 7 threads (more than the cores), at the rows that multiply the codes directly."""
    weight, _ = _gguf_weight(tensor_type, 1000, 576, seed=70)
    lib = _bf16_lib(weight, 2) if dtype == torch.bfloat16 else _rows_lib(weight, 2)
    previous = torch.get_num_threads()
    try:
        for num_rows in (1, 2, 3):
            x = torch.randn(num_rows, 576, generator=torch.Generator().manual_seed(num_rows)).to(dtype)
            results = []
            for threads in (1, 2, 3, 7):
                torch.set_num_threads(threads)
                if dtype == torch.bfloat16:
                    results.append(_bf16_rows(lib, weight, x))
                else:
                    results.append(block_quant.block_quant_linear_native(x, weight, None, lib))
            assert all(torch.equal(result, results[0]) for result in results[1:]), num_rows
            torch.testing.assert_close(results[0].float(), block_quant.block_quant_linear_ref(x.float(), weight),
                                       rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("tensor_type", TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_bound_call_writes_what_block_quant_linear_returns(tensor_type, dtype, with_bias):
    """ops.bound_block_quant_linear, called again after x changes, writes ops.block_quant_linear's
    result bit for bit; None under the references and above the kernel's rows."""
    weight, _ = _gguf_weight(tensor_type, 70, 128, seed=11)
    lib = _rows_lib(weight, 3)
    bias = torch.randn(70).to(dtype) if with_bias else None
    x = torch.empty(3, 128, dtype=dtype)
    out = torch.empty(3, 70, dtype=dtype)
    call = ops.bound_block_quant_linear(x, weight, bias, out=out)
    if dtype == torch.bfloat16 and not block_quant._has_bf16(lib):
        assert call is None  # the float32 kernel would first convert x: the caller takes block_quant_linear
        return
    assert call is not None
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x.copy_(torch.randn(3, 128, generator=generator))
        call()
        assert torch.equal(out, ops.block_quant_linear(x, weight, bias))
    rows = (tuning.block_panel_rows(lib) if dtype == torch.bfloat16 and block_quant._has_bf16(lib)
            else block_quant.MAX_ROWS)
    big = torch.empty(rows + 1, 128, dtype=dtype)
    assert ops.bound_block_quant_linear(big, weight, out=torch.empty(big.shape[0], 70, dtype=dtype)) is None


def test_the_bound_call_is_refused_under_the_references(monkeypatch):
    weight, _ = _gguf_weight("Q4_1", 64, 128, seed=12)
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    x = torch.zeros(1, 128)
    assert ops.bound_block_quant_linear(x, weight, out=torch.empty(1, 64)) is None
