"""Decode steps of a few rows through whole Llama decoder layers in native code: one C call per
layer (kernels/native/decode_layer.c) instead of a dozen Python-level calls of the per-op
kernels, whose chain it runs (RMSNorm, the few-rows linear, RoPE with the K/V write, attention,
SiLU-mul). At one sequence each of those calls costs Python and ctypes time on top of its work,
and a model of many small layers makes dozens of them per layer (docs/kernels.md has the
measurements).

    step = NativeDecodeStep.for_step(model, metadata, kv_caches)   # None: the model's own loop runs
    hidden, residual = step.run(hidden)                            # after the embedding

It applies when every row of the step is a one-token decode, there are at most MAX_ROWS (4) of
them, the model is bfloat16 or float32 on one CPU rank with dense
(not quantized) linear layers, the caches hold the model's dtype or float32, and the native
library is built. In float32 the results differ from the per-op path in the last bits (sums in
another order: the matmuls, RMSNorm's sum of squares), as bfloat16's do.
Each layer's weight and cache pointers are gathered once into a ctypes structure kept on the
layer (and rebuilt if a tensor moved).
"""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels.linear import native_rows

# up to 4 rows: the row kernel streams the weights at least as fast as oneDNN there (bench/linear_rows.py,
# docs/kernels.md) and the layer saves the per-op calls
MAX_ROWS = 4
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class LayerWeights(ctypes.Structure):  # struct layer_weights in decode_layer.c
    _fields_ = [(name, _P) for name in ("norm1", "norm2", "w_qkv", "b_qkv", "w_o", "b_o", "w_gate_up", "b_gate_up",
                                        "w_down", "b_down", "key_cache", "value_cache")] + [
        (name, _I64) for name in ("hidden", "num_heads", "num_kv_heads", "head_size", "inner", "num_slots",
                                  "block_size")] + [("eps", _F32), ("scale", _F32), ("cache_dtype", _I32),
                                                    ("sliding_window", _I32), ("dtype", _I32)]


class StepRows(ctypes.Structure):  # struct step_rows in decode_layer.c
    _fields_ = [(name, _P) for name in ("cos_sin", "positions", "slot_mapping", "block_tables", "seq_lens",
                                        "query_start_loc", "seqs")] + [("num_rows", _I64), ("max_blocks", _I64)]


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


def _is_dense(linear, dtype: torch.dtype) -> bool:
    weight = linear.weight
    return (linear.packed is None and weight is not None and weight.dtype == dtype and weight.is_contiguous()
            and (linear.bias is None or linear.bias.is_contiguous()))


def _layer_weights(layer, kv_cache, dtype: torch.dtype) -> LayerWeights | None:
    """The layer's structure (cached on it), or None when the layer does not qualify."""
    attention, mlp = layer.self_attn, layer.mlp
    key_cache, value_cache = kv_cache
    cached = getattr(layer, "_native_decode", None)
    if cached is not None and cached[0] == (attention.qkv_proj.weight.data_ptr() if attention.qkv_proj.weight
                                            is not None else None, key_cache.data_ptr(), value_cache.data_ptr()):
        return cached[1]
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not (all(_is_dense(linear, dtype) for linear in linears) and key_cache.dtype in (dtype, torch.float32)
            and key_cache.dtype == value_cache.dtype and key_cache.is_contiguous() and value_cache.is_contiguous()
            and attention.head_size <= 512 and attention.num_heads // attention.num_kv_heads <= 64
            and attention.num_heads // attention.num_kv_heads * attention.head_size <= 8192
            and layer.input_layernorm.weight.dtype == dtype):
        layer._native_decode = None
        return None
    num_blocks, block_size = key_cache.shape[:2]
    weights = LayerWeights(
        _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
        _ptr(attention.qkv_proj.weight), _ptr(attention.qkv_proj.bias), _ptr(attention.o_proj.weight),
        _ptr(attention.o_proj.bias), _ptr(mlp.gate_up_proj.weight), _ptr(mlp.gate_up_proj.bias),
        _ptr(mlp.down_proj.weight), _ptr(mlp.down_proj.bias), key_cache.data_ptr(), value_cache.data_ptr(),
        layer.input_layernorm.hidden_size, attention.num_heads, attention.num_kv_heads, attention.head_size,
        mlp.inner_size, num_blocks * block_size, block_size, layer.input_layernorm.eps, attention.attn.scale,
        DTYPE_CODES[key_cache.dtype], attention.attn.sliding_window or 0, DTYPE_CODES[dtype])
    weights._keep = (key_cache, value_cache)  # the pointers stay valid while the structure lives
    layer._native_decode = ((attention.qkv_proj.weight.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr()),
                            weights)
    return weights


class NativeDecodeStep:
    def __init__(self, lib, model, layer_weights: list[LayerWeights], rows: StepRows, tensors: tuple) -> None:
        self.lib = lib
        self.model = model
        self.layer_weights = [ctypes.addressof(weights) for weights in layer_weights]
        self.rows = rows
        self.rows_address = ctypes.addressof(rows)
        self.tensors = tensors  # keeps the step tensors the structure points into alive

    @classmethod
    def for_step(cls, model, metadata, kv_caches) -> "NativeDecodeStep | None":
        num_rows = metadata.num_tokens
        dtype = model.rotary.cos_sin.dtype
        if not (0 < num_rows <= MAX_ROWS and metadata.num_seqs == num_rows and model.tp.world_size == 1
                and dtype in DTYPE_CODES and model.rotary.cos_sin.device.type == "cpu"):
            return None
        lib = native_rows.library()
        if lib is None or metadata.query_start_loc.tolist() != list(range(num_rows + 1)):
            return None
        layer_weights = []
        for layer, kv_cache in zip(model.layers, kv_caches):
            weights = _layer_weights(layer, kv_cache, dtype)
            if weights is None:
                return None
            layer_weights.append(weights)
        model.rotary.check_positions(metadata.positions, metadata.step_plans)
        block_tables = metadata.block_tables.to(torch.int32).contiguous()
        seq_lens = metadata.seq_lens.to(torch.int32).contiguous()
        query_start_loc = metadata.query_start_loc.to(torch.int32).contiguous()
        positions = metadata.positions.contiguous()
        slot_mapping = metadata.slot_mapping.contiguous()
        seqs = torch.arange(num_rows)
        rows = StepRows(model.rotary.cos_sin.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
                        block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(), seqs.data_ptr(),
                        num_rows, block_tables.shape[1])
        return cls(lib, model, layer_weights, rows,
                   (block_tables, seq_lens, query_start_loc, positions, slot_mapping, seqs))

    def run(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [M, H] (the embeddings) -> (last layer's output, residual stream), as the layer loop returns."""
        num_rows, size = hidden.shape
        first = self.model.layers[0]
        attention, inner = first.self_attn, first.mlp.inner_size
        qkv_width = (attention.num_heads + 2 * attention.num_kv_heads) * attention.head_size
        scratch = torch.empty(num_rows * (2 * size + qkv_width + attention.num_heads * attention.head_size
                                          + 3 * inner), dtype=hidden.dtype)
        hidden = hidden.contiguous()
        residual = None
        run_layer = self.lib.decode_layer
        for weights in self.layer_weights:
            out = torch.empty(num_rows, size, dtype=hidden.dtype)
            run_layer(weights, self.rows_address, hidden.data_ptr(),
                      residual.data_ptr() if residual is not None else None, residual is not None, out.data_ptr(),
                      scratch.data_ptr())
            if residual is None:
                residual = hidden
            hidden = out
        return hidden, residual
