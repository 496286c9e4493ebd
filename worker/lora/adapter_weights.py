"""One rank's shard of a LoRA adapter's weights, read from its PEFT folder.

Tensor parallelism splits each delta like the layer it adds to:

    column layers (q, k, v, gate, up)   y_local += scale * (x @ A^T) @ B[rows of this rank]^T
    row layers (o, down)                y       += scale * all_reduce(x_local @ A[:, cols of this rank]^T) @ B^T

so A is whole and B sliced for a column layer, A sliced and B whole for a row layer. The scale is
folded into B when the adapter is loaded. The parts of a fused layer (q, k, v; gate, up) are
fused too: their A stacked, their B block-diagonal, so one pair of matmuls serves the whole layer:

    A_qkv = [A_q; A_k; A_v]            [3r, in]
    B_qkv = diag(B_q, B_k, B_v)        [q_local + 2 kv_local, 3r]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from pagedserve.adapters.peft_folder import WEIGHTS_FILE, AdapterSpec
from pagedserve.worker.layers.tensor_parallel import ShardRange

COLUMN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PROJECTIONS = ("o_proj", "down_proj")


@dataclass(slots=True)
class ModuleDelta:
    a: torch.Tensor  # [r, in_local]
    b: torch.Tensor  # [out_local, r], scale included


FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


@dataclass(slots=True)
class AdapterWeights:
    spec: AdapterSpec
    deltas: dict[tuple[int, str], ModuleDelta]  # (layer, layer name of FUSED_LAYERS) -> this rank's delta

    @property
    def num_bytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                   for d in self.deltas.values())


def model_shards(model) -> dict[str, ShardRange]:
    """projection -> this rank's output rows (column layers) or input columns (row layers)."""
    attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
    q, k, v = attention.qkv_proj.shards
    gate, up = mlp.gate_up_proj.shards
    return {"q_proj": q, "k_proj": k, "v_proj": v, "gate_proj": gate, "up_proj": up,
            "o_proj": attention.o_proj.input_shard, "down_proj": mlp.down_proj.input_shard}


def load_adapter_weights(spec: AdapterSpec, shards: dict[str, ShardRange], *, dtype: torch.dtype,
                         device: torch.device) -> AdapterWeights:
    """Reads only this rank's slices of each lora_A / lora_B (the spec was checked by read_adapter)."""
    parts = {}
    with safe_open(f"{spec.path}/{WEIGHTS_FILE}", framework="pt") as f:
        for (layer, projection), (a_name, b_name) in spec.modules.items():
            shard = shards[projection]
            a_full, b_full = f.get_slice(a_name), f.get_slice(b_name)
            if projection in ROW_PROJECTIONS:
                a = a_full[:, shard.start: shard.start + shard.size]
                b = b_full[:, :]
            else:
                a = a_full[:, :]
                b = b_full[shard.start: shard.start + shard.size, :]
            a = a.to(device=device, dtype=torch.float32)
            b = b.to(device=device, dtype=torch.float32) * spec.scale
            parts[(layer, projection)] = ModuleDelta(a, b)
    deltas = {}
    for layer in sorted({layer for layer, _ in parts}):
        for name, projections in FUSED_LAYERS.items():
            present = [(p, parts[(layer, p)]) for p in projections if (layer, p) in parts]
            if not present:
                continue
            rank = spec.rank
            in_size = present[0][1].a.shape[1]
            out_sizes = [parts[(layer, p)].b.shape[0] if (layer, p) in parts else shards[p].size
                         for p in projections]  # a column part's local rows; a row layer's whole output
            a = torch.zeros(rank * len(projections), in_size, device=device)
            b = torch.zeros(sum(out_sizes), rank * len(projections), device=device)
            for index, projection in enumerate(projections):
                if (layer, projection) in parts:
                    delta = parts[(layer, projection)]
                    row = sum(out_sizes[:index])
                    a[index * rank:(index + 1) * rank] = delta.a
                    b[row:row + out_sizes[index], index * rank:(index + 1) * rank] = delta.b
            deltas[(layer, name)] = ModuleDelta(a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return AdapterWeights(spec, deltas)
