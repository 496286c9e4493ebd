"""Quantization options, tensor-parallel group checks and GGUF-style pre-quantized weights."""

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
from pagedserve.worker.quantization.linear import load_prequantized, quantize_model
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


def test_prequantized_weight_validates_and_slices_on_groups():
    weight = q4_1(_dense(32, 128))
    assert weight.narrow(1, 64, 64).shape == (32, 64)
    assert torch.equal(weight.narrow(1, 64, 64).dequantize(), weight.dequantize()[:, 64:])
    with pytest.raises(QuantizationError, match="group boundaries"):
        weight.narrow(1, 48, 64)
    with pytest.raises(QuantizationError, match="scales"):
        QuantizedWeight(4, weight.values, weight.scales[:, :2], weight.offsets)
    with pytest.raises(QuantizationError, match="symmetric"):
        QuantizedWeight(8, weight.values.to(torch.int8), weight.scales, weight.offsets)


class _TwoLayerShard(torch.nn.Module):
    """Rank 1 of 2: a fused column-parallel layer (q, k) and a row-parallel one, as a model exposes them."""

    def __init__(self) -> None:
        super().__init__()
        tp = TensorParallelGroup()
        self.qk = ColumnParallelLinear(128, [ShardRange(64, 32, 32), ShardRange(32, 16, 16)], bias=False,
                                       dtype=torch.float32, device="cpu")
        self.down = RowParallelLinear(ShardRange(128, 64, 64), 32, bias=False, tp=tp, dtype=torch.float32,
                                      device="cpu")

    def checkpoint_slices(self):
        return (self.qk.checkpoint_slices("qk", ["q", "k"]) + self.down.checkpoint_slices("down", "down"))


def test_load_prequantized_slices_and_fuses_for_the_rank():
    full = {"q.weight": _dense(64, 128, 2), "k.weight": _dense(32, 128, 3), "down.weight": _dense(32, 128, 4)}
    tensors = {name: q4_1(weight) for name, weight in full.items()}
    model = _TwoLayerShard()
    assert load_prequantized(model, tensors) == set(full)
    expected_qk = torch.cat([tensors["q.weight"].dequantize()[32:64], tensors["k.weight"].dequantize()[16:32]])
    assert torch.equal(model.qk.packed.dequantize(), expected_qk)
    expected_down = tensors["down.weight"].dequantize()[:, 64:]
    assert torch.equal(model.down.packed.dequantize(), expected_down)
    assert model.qk.weight is None and model.down.weight is None


def test_load_prequantized_requantizes_mixed_fused_parts_as_int8():
    model = _TwoLayerShard()
    tensors = {"q.weight": q4_1(_dense(64, 128, 5)), "k.weight": q8_0(_dense(32, 128, 6))}
    assert load_prequantized(model, tensors) == {"q.weight", "k.weight"}
    assert isinstance(model.qk.packed, Int8Weight)
    assert model.down.packed is None and model.down.weight is not None  # not in `tensors`: left dense


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
