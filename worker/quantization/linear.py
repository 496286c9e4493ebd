"""Linear layers whose weight may be held quantized, and how a model's layers get quantized.

`QuantizableLinear` is the base of the column- and row-parallel layers: until quantized it holds
a dense `weight` [out_local, in_local]; afterwards `packed` (an Int8Weight or Int4Weight) and the
dense weight is gone. The packed tensors are registered as parameters (requires_grad False), so
device moves, `parameters()` and the weight-byte count see them.

    quantize_model(model, config)   after a dense load: quantizes every such layer in place
    pack_parts(parts)               a GGUF layer's pre-quantized parts in the kernel form (the GGUF
                                    loader, pagedserve.worker.loading.gguf_weights, reads this rank's
                                    slices of them and sets the result with set_packed_weight)

Quantizing after the dense load keeps the loader unchanged; the price is that the rank's dense
shard is resident until quantize_model runs, each layer's dense weight being freed as soon as
its quantized form exists.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import ops
from pagedserve.kernels.ops import PackedWeight
from pagedserve.worker.quantization.quantizers import (
    QuantizationConfig,
    QuantizationError,
    QuantizedWeight,
    check_groups_fit_shard,
    quantize,
)


class QuantizableLinear(torch.nn.Module):
    """Subclasses create `self.weight` and `self.bias` and describe their input shard."""

    packed: PackedWeight | None = None
    prepacked_weight: object | None = None  # panels or oneDNN copy (worker/loading/prepacked_weights.py)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, in] -> [T, out]
        return ops.linear(x, self.weight, bias, packed=self.packed, prepacked=self.prepacked_weight)

    def input_range(self) -> tuple[int, int, int]:
        """(full input size, this rank's first input, its number of inputs)."""
        raise NotImplementedError

    def set_packed_weight(self, packed: PackedWeight) -> None:
        """Replaces the dense (or an earlier packed) weight by `packed`, moved to the layer's device."""
        current = self.weight if self.weight is not None else next(iter(self.packed.tensors().values()))
        num_out = self.weight.shape[0] if self.weight is not None else self.packed.out_features
        num_in = self.input_range()[2]
        if (packed.out_features, packed.in_features) != (num_out, num_in):
            raise QuantizationError(f"packed weight [{packed.out_features}, {packed.in_features}] does not "
                                    f"fit a layer of [{num_out}, {num_in}]")
        device = current.device
        if self.packed is not None:
            for name in self.packed.tensors():
                delattr(self, f"weight_{name}")
        for name, tensor in packed.tensors().items():
            setattr(self, f"weight_{name}", torch.nn.Parameter(tensor.to(device), requires_grad=False))
        # the dataclass must see the parameters' tensors, which module.to() updates in place
        tensors = {name: getattr(self, f"weight_{name}") for name in packed.tensors()}
        self.packed = type(packed)(**{**_fields(packed), **tensors})
        self.weight = None
        self.prepacked_weight = None

    def quantize_weight(self, config: QuantizationConfig, layer_name: str = "") -> None:
        if self.weight is None:
            return  # already quantized (pre-quantized checkpoint)
        if config.method == "int4":
            full_size, start, size = self.input_range()
            if size != full_size:
                check_groups_fit_shard(layer_name or type(self).__name__, full_size, start, size,
                                       config.int4_group_size)
        self.set_packed_weight(quantize(self.weight.data, config))


def _fields(packed: PackedWeight) -> dict:
    return {name: getattr(packed, name) for name in packed.__dataclass_fields__}


def quantize_model(model: torch.nn.Module, config: QuantizationConfig) -> int:
    """Quantizes every QuantizableLinear of `model` in place; returns how many."""
    if not config.is_enabled:
        return 0
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantizableLinear):
            module.quantize_weight(config, name)
            count += 1
    return count


def pack_parts(parts: list[QuantizedWeight]) -> PackedWeight:
    """One layer's pre-quantized parts (q, k, v; gate, up; or a single weight), row after row, in
    the kernel form; parts in different formats are requantized together as int8 per channel."""
    if all(part.has_format_of(parts[0]) for part in parts):
        return QuantizedWeight.cat_rows(parts).to_packed()
    dense = torch.cat([part.dequantize() for part in parts])
    return quantize(dense, QuantizationConfig("int8"))
