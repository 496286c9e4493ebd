"""Whole Llama decoder layers in one native call each (kernels/native/decode_layer.c), for decode
steps of a few rows: the chain of the per-op kernels (RMSNorm, the few-rows linear or the GGUF
block kernel, RoPE with the K/V write, decode attention, SiLU-mul) without a Python-level call
between them. Reference: the
model's own layer loop on the per-op path (tests/worker/test_native_decode_layer.py).

    lib = decode_layer_library()                        # None: no native library or no row kernels
    weights = layer_weights(norm1, norm2, qkv, o, ...)  # once per layer, kept by the caller
    hidden, residual = DecodeLayers(lib, [weights, ...], rows_of_the_step).run(hidden)

The structures hold raw pointers: a LayerWeights keeps its caches alive, a DecodeLayers the step
tensors it points into, and the caller rebuilds a layer's structure when one of its tensors moves.
`supports_decode_layer` says whether a layer's dtypes, caches and head shapes fit the C code.
"""

from __future__ import annotations

import ctypes
from functools import cached_property, partial

import torch

from pagedserve.kernels.attention.native import MAX_GROUP, MAX_GROUP_WIDTH, MAX_HEAD_SIZE
from pagedserve.kernels.linear import native_rows
from pagedserve.kernels.linear.block_quant import BlockQuantWeight
from pagedserve.kernels.linear.panels import PanelWeight
from pagedserve.kernels.native import library as native_lib
from pagedserve.kernels.native.abi import DTYPE_CODES, BlockLinear, LayerWeights, StepRows

# (weight [out, in] dense in the layer's dtype, bfloat16 panels (linear/panels.py), or GGUF blocks kept
# as the file has them; bias [out] or None)
Linear = tuple[torch.Tensor | PanelWeight | BlockQuantWeight, torch.Tensor | None]


def decode_layer_library():
    """The native library where it has the row kernels the layer chains (AVX-512 BF16), or else the
    float32 row kernel or the GGUF block kernel (AVX2 and up), for the layers chains_dense allows;
    None without any of them."""
    lib = native_rows.library()
    if lib is None:
        lib = native_lib.load()
        if lib is None or not (native_lib.has_kernel(lib, "linear_rows_f32")
                               or native_lib.has_kernel(lib, "block_quant_rows")):
            return None
    return lib


def chains_dense(lib, dtype: torch.dtype) -> bool:
    """Whether decode_layer.c multiplies dense weights (and panels) of `dtype` on this library:
    bfloat16 needs the row kernels (AVX-512 BF16), float32 the float32 row kernel (AVX-512, or its
    AVX2 twin). Where bfloat16 has no row kernels it has no bfloat16 block kernel either: such a
    layer is left to the per-op path."""
    return native_lib.has_kernel(lib, "linear_rows" if dtype == torch.bfloat16 else "linear_rows_f32")


def supports_decode_layer(dtype: torch.dtype, key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int,
                          num_kv_heads: int, head_size: int) -> bool:
    """Activations and weights in `dtype` (float32 or bfloat16), caches contiguous in it or float32,
    and the head shapes within decode_attention.c's stack buffers."""
    group = num_heads // num_kv_heads
    return (dtype in DTYPE_CODES and key_cache.dtype in (dtype, torch.float32) and value_cache.dtype == key_cache.dtype
            and key_cache.is_contiguous() and value_cache.is_contiguous() and head_size <= MAX_HEAD_SIZE
            and group <= MAX_GROUP and group * head_size <= MAX_GROUP_WIDTH)


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


def layer_weights(norm1: torch.Tensor, norm2: torch.Tensor, qkv: Linear, o: Linear, gate_up: Linear, down: Linear,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                  head_size: int, eps: float, scale: float, sliding_window: int | None,
                  panels: list[PanelWeight | None] | None = None) -> LayerWeights:
    """One layer's structure: norms [H], contiguous weights in the norms' dtype, bfloat16 panels or
    GGUF blocks (and biases or None), caches [num_blocks, block_size, kvh, hs] (supports_decode_layer).
    `panels`: per projection, the panels of a dense weight, which decode_layer.c multiplies above
    two rows (as ops.linear does), the dense weight at one or two."""
    num_blocks, block_size = key_cache.shape[:2]
    linears = (qkv, o, gate_up, down)
    blocks = [BlockLinear(weight.qs.data_ptr(), weight.scales.data_ptr(), _ptr(weight.mins), weight.bits)
              if isinstance(weight, BlockQuantWeight) else None for weight, _ in linears]
    panels = [weight if isinstance(weight, PanelWeight) else extra
              for (weight, _), extra in zip(linears, panels or [None] * len(linears))]
    panel_pointers = [weight.data.data_ptr() if weight is not None else None for weight in panels]
    dense = [weight.data_ptr() if isinstance(weight, torch.Tensor) else None for weight, _ in linears]
    inner = down[0].shape[1] if isinstance(down[0], torch.Tensor) else down[0].in_features
    weights = LayerWeights(
        _ptr(norm1), _ptr(norm2), dense[0], _ptr(qkv[1]), dense[1], _ptr(o[1]), dense[2], _ptr(gate_up[1]),
        dense[3], _ptr(down[1]), key_cache.data_ptr(), value_cache.data_ptr(), norm1.shape[0], num_heads,
        num_kv_heads, head_size, inner, num_blocks * block_size, block_size, eps, scale,
        DTYPE_CODES[key_cache.dtype], sliding_window or 0, DTYPE_CODES[norm1.dtype],
        *[ctypes.addressof(block) if block is not None else None for block in blocks], *panel_pointers)
    # the pointers stay valid while the structure lives
    weights._keep = (key_cache, value_cache, blocks, [weight for weight, _ in linears], panels)
    return weights


_ROW_INDICES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _row_indices(num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query_start_loc (0..M, int32) and seqs (0..M-1, int64) of a step of M one-token rows, made
    once per M: the C code only reads them."""
    indices = _ROW_INDICES.get(num_rows)
    if indices is None:
        indices = _ROW_INDICES[num_rows] = (torch.arange(num_rows + 1, dtype=torch.int32), torch.arange(num_rows))
    return indices


def layer_addresses(layers: list[LayerWeights]):
    """The array of the structures' addresses that decode_layers takes: a caller that keeps its list
    of structures across steps keeps this array beside it and passes it to DecodeLayers."""
    return (ctypes.c_void_p * len(layers))(*[ctypes.addressof(weights) for weights in layers])


class DecodeLayers:
    """One decode step of M rows, row i being sequence i's one new token, through a list of layers."""

    def __init__(self, lib, layers: list[LayerWeights], cos_sin: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 addresses=None) -> None:
        """cos_sin [P, 2 hs] in the layers' dtype; positions, slot_mapping [M] int64; block_tables
        [M, max_blocks]; seq_lens [M]; addresses: layer_addresses(layers), when the caller keeps it."""
        num_rows = positions.shape[0]
        block_tables = block_tables.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        query_start_loc, seqs = _row_indices(num_rows)
        positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
        self.rows = StepRows(cos_sin.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
                             block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(), seqs.data_ptr(),
                             num_rows, block_tables.shape[1])
        self.tensors = (cos_sin, block_tables, seq_lens, query_start_loc, positions, slot_mapping, seqs)
        self.lib = lib
        self.first = layers[0]
        self.layer_array = addresses if addresses is not None else layer_addresses(layers)
        self.layers = layers  # keeps the structures alive
        self.rows_address = ctypes.addressof(self.rows)

    @cached_property
    def all_blocks(self) -> bool:
        """Every projection of every layer in GGUF blocks (a kept file's layers); asked of float32
        models only (llama_native.final_hidden), so a bfloat16 step never reads the structures."""
        return all(layer.qkv_blocks and layer.o_blocks and layer.gate_up_blocks and layer.down_blocks
                   for layer in self.layers)

    def run(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [M, H] (the embeddings) -> (last layer's output, residual stream), as a layer loop
        returns: one native call for all the layers (decode_layers), the embeddings becoming the
        residual stream in place."""
        num_rows, size = hidden.shape
        scratch = self._scratch(num_rows, size, hidden.dtype)
        hidden = hidden.contiguous()
        out, spare = torch.empty(2, num_rows, size, dtype=hidden.dtype)
        self.lib.decode_layers(self.layer_array, len(self.layers), self.rows_address, hidden.data_ptr(),
                               out.data_ptr(), spare.data_ptr(), scratch.data_ptr())
        return out, hidden

    def run_step(self, token_ids: torch.Tensor, embedding: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [M] int64 -> the final-normed hidden states [M, H] of every row, in one native call
        (decode_step): the rows of embedding [vocab, H] (dense, the layers' dtype), the layers, then
        RMSNorm(residual + last output) with norm_weight [H]; into `out` [M, H] (contiguous, the
        embedding's dtype) when given. IndexError, as an embedding lookup raises, when a token id is
        outside the table."""
        if out is None:
            out = torch.empty(token_ids.shape[0], embedding.shape[1], dtype=embedding.dtype)
        self.bound_step(token_ids, embedding, norm_weight, eps, out)()
        return out

    def bound_step(self, token_ids: torch.Tensor, embedding: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   out: torch.Tensor):
        """run_step(token_ids, embedding, norm_weight, eps, out) as a call without arguments, bound to
        these tensors (the caller keeps them and changes only their values), its residual stream,
        spare output and scratch allocated once: a decode run calls it every step without the
        allocations (run_step binds and calls it once). The buffers carry nothing from one call to
        the next: decode_step writes the residual stream from the embeddings and every scratch value
        before it reads it."""
        num_rows, size = token_ids.shape[0], embedding.shape[1]
        if out.shape != (num_rows, size) or out.dtype != embedding.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{num_rows}, {size}] {embedding.dtype} tensor")
        if not (token_ids.dtype == torch.int64 and token_ids.is_contiguous() and embedding.is_contiguous()):
            raise ValueError("token_ids must be contiguous int64 and the embedding contiguous")
        residual = torch.empty(num_rows, size, dtype=embedding.dtype)
        spare = torch.empty(num_rows, size, dtype=embedding.dtype)
        scratch = self._scratch(num_rows, size, embedding.dtype)
        call = partial(self.lib.decode_step, self.layer_array, len(self.layers), self.rows_address,
                       token_ids.data_ptr(), embedding.data_ptr(), embedding.shape[0], norm_weight.data_ptr(), eps,
                       residual.data_ptr(), out.data_ptr(), spare.data_ptr(), scratch.data_ptr())
        # what the pointers point into: these tensors, and this object's step rows and their tensors
        kept = (self, token_ids, embedding, norm_weight, residual, out, spare, scratch)

        def step() -> None:
            if not call():
                raise IndexError(f"a token id outside the embedding table of {embedding.shape[0]} rows")

        step.kept = kept
        step.args = call.args  # decode_step's arguments (kernels/layer/decode_run.py)
        return step

    def _scratch(self, num_rows: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        """What decode_layer.c needs beside its inputs and outputs (its module comment)."""
        first = self.first
        q_width = first.num_heads * first.head_size
        qkv_width = q_width + 2 * first.num_kv_heads * first.head_size
        num_elements = num_rows * (2 * size + qkv_width + q_width + 3 * first.inner)
        # then float32 outputs of the block kernels (decode_layer.c), 64-byte aligned
        num_elements += (64 + 4 * num_rows * 2 * first.inner) // dtype.itemsize
        return torch.empty(num_elements, dtype=dtype)
