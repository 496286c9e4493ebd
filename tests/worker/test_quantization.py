"""Quantization options, tensor-parallel group checks and GGUF-style pre-quantized weights (the GGUF
loader reads each rank's slices and packs them with pack_parts: tests/worker/test_gguf_packed.py and
test_gguf_tensor_parallel.py load real files)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.linear.block_quant import BlockQuantWeight
from pagedserve.kernels.linear.packed_weights import Int4Weight, Int8Weight
from pagedserve.worker.layers.parallel import ColumnParallelLinear, RowParallelLinear
from pagedserve.worker.quantization.quantizers import (
    QuantizationConfig,
    QuantizationError,
    QuantizedWeight,
    quantize_int4,
)
from pagedserve.worker.quantization.linear import pack_parts, quantize_model
from pagedserve.worker.layers.tensor_parallel import ShardRange, TensorParallelGroup


def _dense(num_rows: int, num_cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, num_cols, generator=torch.Generator().manual_seed(seed)) / num_cols ** 0.5


def q4_1(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """What a GGUF Q4_1 tensor holds: codes 0..15, a float16 scale and minimum per group of 32."""
    groups = weight.view(weight.shape[0], -1, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).to(torch.float16)
    codes = torch.round((groups - low[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return QuantizedWeight(4, codes.view_as(weight).to(torch.uint8), scales, low.to(torch.float16), group_size)


def q4_0(weight: torch.Tensor) -> QuantizedWeight:
    groups = weight.view(weight.shape[0], -1, 32)
    scales = (groups.abs().amax(-1) / 8).to(torch.float16)
    codes = (torch.round(groups / scales.float()[..., None]) + 8).clamp(0, 15)
    return QuantizedWeight(4, codes.view_as(weight).to(torch.uint8), scales, -8 * scales, 32)


def q8_0(weight: torch.Tensor) -> QuantizedWeight:
    groups = weight.view(weight.shape[0], -1, 32)
    scales = (groups.abs().amax(-1) / 127).to(torch.float16)
    codes = torch.round(groups / scales.float()[..., None]).clamp(-127, 127)
    return QuantizedWeight(8, codes.view_as(weight).to(torch.int8), scales, None, 32)


def _relative_error(actual, expected) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def test_config_validates():
    assert not QuantizationConfig().is_enabled
    assert not QuantizationConfig("auto").is_enabled and QuantizationConfig("auto").keeps_checkpoint_quantization
    assert not QuantizationConfig("none").keeps_checkpoint_quantization
    assert QuantizationConfig("int4").int4_group_size == 32
    assert QuantizationConfig("int4", 32).int4_group_size == 32
    with pytest.raises(QuantizationError, match="one of auto, none, int8, int4"):
        QuantizationConfig("fp4")
    with pytest.raises(QuantizationError, match="group size"):
        QuantizationConfig("int4", 100)


def test_row_parallel_int4_groups_must_not_straddle_the_shard():
    tp = TensorParallelGroup()
    layer = RowParallelLinear(ShardRange(192, 96, 96), 32, bias=False, tp=tp, dtype=torch.float32, device="cpu")
    layer.weight.data.copy_(_dense(32, 96))
    with pytest.raises(QuantizationError, match=r"down_proj: int4 groups of 64 .* inputs 96\.\.191 of 192"):
        layer.quantize_weight(QuantizationConfig("int4", 64), "down_proj")
    layer.quantize_weight(QuantizationConfig("int4", 32), "down_proj")  # 96 = 3 x 32: fine
    assert isinstance(layer.packed, Int4Weight) and layer.weight is None
    last = RowParallelLinear(ShardRange(160, 128, 32), 32, bias=False, tp=tp, dtype=torch.float32, device="cpu")
    last.weight.data.copy_(_dense(32, 32))
    with pytest.raises(QuantizationError, match="straddle"):
        last.quantize_weight(QuantizationConfig("int4", 256))  # starts inside a group
    last.quantize_weight(QuantizationConfig("int4", 32))


def test_quantized_layer_counts_its_packed_bytes_and_forwards():
    layer = ColumnParallelLinear(64, [ShardRange(48, 0, 48), ShardRange(32, 0, 32)], bias=True,
                                 dtype=torch.float32, device="cpu")
    layer.weight.data.copy_(_dense(80, 64))
    layer.bias.data.normal_()
    x = torch.randn(3, 64)
    dense_out = layer(x)
    assert quantize_model(layer, QuantizationConfig("int8")) == 1
    params = dict(layer.named_parameters())
    assert set(params) == {"bias", "weight_qweight", "weight_scales"}
    assert params["weight_qweight"].dtype == torch.int8 and params["weight_qweight"].numel() == 80 * 64
    assert _relative_error(layer(x), dense_out) < 0.02
    assert layer.packed.qweight is params["weight_qweight"]


def test_prequantized_blocks_are_kept_exactly():
    dense = _dense(48, 96, seed=1)
    for make, bits in ((q4_1, 4), (q4_0, 4), (q8_0, 8)):
        weight = make(dense)
        packed = weight.to_packed()
        assert isinstance(packed, BlockQuantWeight) and packed.bits == bits
        assert packed.scales.dtype == torch.float16
        assert torch.equal(packed.dequantize(), weight.dequantize())  # float16 scales and mins, exactly
        assert _relative_error(weight.dequantize(), dense) < 0.1


def test_prequantized_weight_validates_its_groups():
    weight = q4_1(_dense(32, 128))
    assert weight.shape == (32, 128)
    with pytest.raises(QuantizationError, match="scales"):
        QuantizedWeight(4, weight.values, weight.scales[:, :2], weight.offsets)
    with pytest.raises(QuantizationError, match="symmetric"):
        QuantizedWeight(8, weight.values.to(torch.int8), weight.scales, weight.offsets)
    with pytest.raises(QuantizationError, match="groups of 32"):
        QuantizedWeight(4, weight.values[:, :48], weight.scales[:, :1], weight.offsets[:, :1])


def test_pack_parts_fuses_parts_of_one_format_as_they_are():
    """q and k of one rank (what the GGUF loader reads for a fused layer): the file's blocks kept
    exactly (codes, float16 scales and minimums), rows in order."""
    q, k = q4_1(_dense(32, 128, 2)), q4_1(_dense(16, 128, 3))
    packed = pack_parts([q, k])
    assert isinstance(packed, BlockQuantWeight) and (packed.out_features, packed.in_features) == (48, 128)
    expected = torch.cat([q.dequantize(), k.dequantize()])
    assert torch.equal(packed.dequantize(), expected)


def test_pack_parts_requantizes_mixed_fused_parts_as_int8():
    q, k = q4_1(_dense(64, 128, 5)), q8_0(_dense(32, 128, 6))
    packed = pack_parts([q, k])
    assert isinstance(packed, Int8Weight) and (packed.out_features, packed.in_features) == (96, 128)
    expected = torch.cat([q.dequantize(), k.dequantize()])
    assert _relative_error(packed.dequantize(), expected) < 0.01


def test_a_layer_takes_a_packed_weight_only_of_its_own_shape():
    layer = ColumnParallelLinear(128, [ShardRange(64, 32, 32), ShardRange(32, 16, 16)], bias=False,
                                 dtype=torch.float32, device="cpu")
    with pytest.raises(QuantizationError, match=r"does not fit a layer of \[48, 128\]"):
        layer.set_packed_weight(pack_parts([q4_1(_dense(32, 128, 7))]))
    layer.set_packed_weight(pack_parts([q4_1(_dense(32, 128, 8)), q4_1(_dense(16, 128, 9))]))
    assert layer.weight is None and isinstance(layer.packed, BlockQuantWeight)


def test_quantize_int4_of_a_prequantized_grid_is_lossless():
    """Weights already on a 4-bit grid (per group of 32) come back exactly from our own quantizer."""
    weight = q4_1(_dense(32, 64, 7)).to_packed().dequantize()
    assert _relative_error(quantize_int4(weight, 32).dequantize(), weight) < 5e-3


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_codes_are_chosen_for_the_stored_zero(group_size):
    """Groups far from zero (bfloat16 then rounds the zero coarsely): every weight stays within half
    a step of its stored value, so the codes were chosen against the stored (scale, zero)."""
    generator = torch.Generator().manual_seed(3)
    dense = 5.0 + 0.1 * torch.rand(64, 256, generator=generator)  # [N, K]
    packed = quantize_int4(dense, group_size)
    steps = packed.scales_and_zeros[..., 0].to(torch.float32).t().repeat_interleave(group_size, dim=1)  # [N, K]
    error = (packed.dequantize() - dense).abs()
    assert bool((error <= steps / 2 * (1 + 1e-3)).all()), float((error / steps).max())
