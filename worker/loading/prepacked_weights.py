"""After the load: the dense bfloat16 CPU weights of the linear layers and of the LM head
prepacked once, so that no step reorders them again (ops.prepack_weight): into 16-column panels
for the native panel kernel where the host's tuning chose them, else into oneDNN's blocked layout
(bit-identical to F.linear; the panels differ in the order of float32 sums). docs/kernels.md has
the measurements.

    prepack_model(model) -> bytes the prepacked copies hold (0 where nothing qualifies)

Quantized layers (their `packed` weights), float32 and float16 models, CUDA, and
PAGEDSERVE_KERNELS=reference keep F.linear on the dense weight. Layers with a prepacked weight
take the native few-rows kernel on the dense weight when a step has at most two rows, the
prepacked copy above (ops.linear picks).
"""

from __future__ import annotations

import torch

from pagedserve.kernels import ops
from pagedserve.worker.layers.parallel import ParallelLMHead
from pagedserve.worker.quantization.linear import QuantizableLinear


def prepack_model(model: torch.nn.Module) -> int:
    """Sets `prepacked_weight` on every QuantizableLinear (not quantized) and ParallelLMHead whose
    weight qualifies; returns the bytes held by the prepacked copies."""
    num_bytes = 0
    for module in model.modules():
        if isinstance(module, QuantizableLinear) and module.packed is None:
            weight = module.weight
        elif isinstance(module, ParallelLMHead):
            weight = module.weight
        else:
            continue
        prepacked = ops.prepack_weight(weight) if weight is not None else None
        if prepacked is not None:
            module.prepacked_weight = prepacked
            held = prepacked.data if isinstance(prepacked, ops.PanelWeight) else weight  # panels pad to 16 columns
            num_bytes += held.numel() * held.element_size()
    return num_bytes
