"""Decode steps of a few rows through whole Llama decoder layers in native code: one C call for all
the layers (kernels/native/decode_layer.c) instead of a dozen Python-level calls of the per-op
kernels, whose chain it runs (RMSNorm, the few-rows linear, RoPE with the K/V write, attention,
SiLU-mul). At one sequence each of those calls costs Python and ctypes time on top of its work,
and a model of many small layers makes dozens of them per layer (docs/kernels.md has the
measurements).

    step = NativeDecodeStep.for_step(model, metadata, kv_caches)   # None: the model's own loop runs
    hidden, residual = step.run(hidden)                            # after the embedding
    normed = step.final_hidden(token_ids)  # every row sampled: embedding, layers and final norm at once

    run = NativeDecodeRun.for_rows(model, kv_caches, block_tables, block_size)  # None: forward computes
    run.set_rows(token_ids, positions); logits = run.step()  # the same rows again, one position on

It applies when every row of the step is a one-token decode, or, in bfloat16, a token of a short
prefill chunk (or of a decode with draft tokens to verify): such a token is a row of its own,
which attends as a decode at its position does (its sequence's table, its position + 1 as its
length; each layer writes every row's K/V before any row attends, so the chunk is causal). There
are at most MAX_ROWS (4) rows (MAX_PACKED_ROWS, 32, when every projection is in bfloat16 panels or GGUF blocks, whose
kernels the per-op path calls at any row count too), the model is bfloat16 or float32 on one CPU
rank whose linear layers are dense, in panels or keep a GGUF file's blocks (--quantization auto:
Q4_0, Q4_1, Q8_0; int8/int4 packs are not taken), the caches hold the model's dtype or float32,
and the native library is built (on a CPU without AVX-512 BF16, where it has no bfloat16 row kernels,
float32 layers only: dense through the float32 row kernel's AVX2 twin, or GGUF blocks). In float32
the results differ from the per-op path in the last bits (sums in another order: the matmuls,
RMSNorm's sum of squares), as bfloat16's do.
Each layer's weight and cache pointers are gathered once into the kernel's structure
(ops.layer_weights) kept on the layer, and rebuilt if a tensor moved.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.kernels import ops
from pagedserve.worker.layers.attention import AttentionMetadata

# up to 4 rows: the row kernel streams the weights at least as fast as oneDNN there (bench/linear_rows.py,
# docs/kernels.md) and the layer saves the per-op calls
MAX_ROWS = 4
# layers whose projections are all panels or GGUF blocks multiply them with the same kernels as the
# per-op path at any row count (the block kernel up to its 32 rows): up to 32 rows, the calls saved
MAX_PACKED_ROWS = 32


def _native_weight(linear, dtype: torch.dtype, dense: bool):
    """What the native layer multiplies by: the dense weight in the layer's dtype (its panels beside
    it above two rows: _layer_weights), the panels alone where ops.linear takes them at every row
    count, or GGUF blocks kept as the file has them; None when the layer holds anything else
    (int8/int4 packs), or anything but blocks in a float32 layer where the library has no row
    kernel for the layer's dtype (not dense: a bfloat16 layer then has no block kernel either)."""
    if linear.bias is not None and not linear.bias.is_contiguous():
        return None
    if not dense:
        return linear.packed if isinstance(linear.packed, ops.BlockQuantWeight) and dtype == torch.float32 else None
    if isinstance(linear.packed, ops.BlockQuantWeight):
        return linear.packed
    if isinstance(linear.prepacked_weight, ops.PanelWeight) and ops.panels_for_few_rows():
        return linear.prepacked_weight  # as ops.linear multiplies it (tuning.panels_for_few_rows)
    weight = linear.weight
    if linear.packed is None and weight is not None and weight.dtype == dtype and weight.is_contiguous():
        return weight
    return None


def _layer_weights(layer, kv_cache, dtype: torch.dtype):
    """The layer's ops.LayerWeights (cached on it), or None when the layer does not qualify."""
    attention, mlp = layer.self_attn, layer.mlp
    key_cache, value_cache = kv_cache
    identity = (id(attention.qkv_proj.packed) if attention.qkv_proj.weight is None
                else attention.qkv_proj.weight.data_ptr(), id(attention.qkv_proj.prepacked_weight),
                key_cache.data_ptr(), value_cache.data_ptr())
    cached = getattr(layer, "_native_decode", None)
    if cached is not None and cached[0] == identity:
        return cached[1]
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    dense = ops.chains_dense(ops.decode_layer_library(), dtype)  # the caller (for_step) found the library
    weights = [_native_weight(linear, dtype, dense) for linear in linears]
    if not (all(weight is not None for weight in weights) and layer.input_layernorm.weight.dtype == dtype
            and ops.supports_decode_layer(dtype, key_cache, value_cache, attention.num_heads,
                                          attention.num_kv_heads, attention.head_size)):
        layer._native_decode = None
        return None
    panels = [linear.prepacked_weight if isinstance(linear.prepacked_weight, ops.PanelWeight)
              and dtype == torch.bfloat16 else None for linear in linears]
    weights = ops.layer_weights(
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
        *[(weight, linear.bias) for weight, linear in zip(weights, linears)],
        key_cache, value_cache, num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
        head_size=attention.head_size, eps=layer.input_layernorm.eps, scale=attention.attn.scale,
        sliding_window=attention.attn.sliding_window, panels=panels)
    layer._native_decode = (identity, weights)
    return weights


def _model_layer_weights(model, kv_caches, dtype: torch.dtype) -> tuple[list, object] | None:
    """Every layer's structure and the array of their addresses (ops.layer_addresses), or None when a
    layer does not qualify. Both are kept on the model
    for the list of caches it was built for (held, so that its identity stays its own): asking every
    layer's modules again each step cost about 0.4 ms of a 12 ms decode step at one sequence, and
    even comparing every cache's address took about 0.1 ms once the step's weights had flushed the
    CPU caches. Weights do not move once loaded (steps with LoRA adapters never come here); the
    caches move when init_cache runs again, which allocates a new list (worker/cache_engine.py)."""
    cached = getattr(model, "_native_layers", None)
    if cached is not None and cached[0] is kv_caches and cached[1] == dtype:
        return cached[2:]
    layer_weights = []
    for layer, kv_cache in zip(model.layers, kv_caches):
        weights = _layer_weights(layer, kv_cache, dtype)
        if weights is None:
            model._native_layers = None
            return None
        layer_weights.append(weights)
    model._native_layers = (kv_caches, dtype, layer_weights, ops.layer_addresses(layer_weights))
    return model._native_layers[2:]


def release_native_layers(model) -> None:
    """Drops the layer structures kept on the model and its layers (_model_layer_weights), which hold
    the KV caches they point into: before those caches are replaced, so that the old pool is freed
    before the new one is allocated."""
    model._native_layers = None
    for layer in model.layers:
        layer._native_decode = None


def _is_packed(weights) -> bool:
    """Every projection of the layer has panels or GGUF blocks (its dense weight, if any, serves one
    or two rows only)."""
    return all(panels or blocks for panels, blocks in (
        (weights.qkv_panels, weights.qkv_blocks), (weights.o_panels, weights.o_blocks),
        (weights.gate_up_panels, weights.gate_up_blocks), (weights.down_panels, weights.down_blocks)))


def _is_native_final_dtype(model, layers: "ops.DecodeLayers") -> bool:
    """final_hidden's dtype condition: embedding, final norm and rotary table all bfloat16, or all
    float32 with every layer's projections in GGUF blocks."""
    dtype = model.embed_tokens.weight.dtype
    if not dtype == model.norm.weight.dtype == model.rotary.cos_sin.dtype:
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float32 and layers.all_blocks)


class NativeDecodeStep:
    def __init__(self, model, layers: "ops.DecodeLayers") -> None:
        self.model = model
        self.layers = layers

    @classmethod
    def for_step(cls, model, metadata, kv_caches) -> "NativeDecodeStep | None":
        num_rows = metadata.num_tokens
        dtype = model.rotary.cos_sin.dtype
        chunks = metadata.num_seqs < num_rows  # prefill chunks or drafts: a row per token (module doc)
        if not (0 < num_rows <= MAX_PACKED_ROWS and (not chunks or dtype == torch.bfloat16)
                and model.tp.world_size == 1 and model.rotary.cos_sin.device.type == "cpu"):
            return None
        lib = ops.decode_layer_library()
        if lib is None:
            return None
        block_tables, seq_lens = metadata.block_tables, metadata.seq_lens
        if chunks:
            starts = metadata.query_start_loc
            seq_of_row = torch.repeat_interleave(torch.arange(metadata.num_seqs), starts[1:] - starts[:-1])
            block_tables = block_tables.index_select(0, seq_of_row)
            seq_lens = (metadata.positions + 1).to(torch.int32)
        elif metadata.query_start_loc.tolist() != list(range(num_rows + 1)):
            return None
        layers = _model_layer_weights(model, kv_caches, dtype)
        if layers is None or (num_rows > MAX_ROWS and not all(map(_is_packed, layers[0]))):
            return None
        model.rotary.check_positions(metadata.positions, metadata.step_plans)
        layer_weights, addresses = layers
        return cls(model, ops.DecodeLayers(lib, layer_weights, model.rotary.cos_sin, metadata.positions,
                                           metadata.slot_mapping, block_tables, seq_lens, addresses))

    def run(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [M, H] (the embeddings) -> (last layer's output, residual stream), as the layer loop returns."""
        return self.layers.run(hidden)

    def final_hidden(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """token_ids [M] -> the final-normed hidden states of every row, the embedding and the final
        norm in the same native call as the layers (about 0.15 ms of Python and torch calls a step
        less, with the CPU caches just flushed by the weights); None unless the model is bfloat16, or
        float32 with its layers' projections all in GGUF blocks, with a dense embedding table (the
        caller then runs them itself). In bfloat16 the native norm is the one ops.add_rms_norm calls,
        so the result is the same bits. Float32 layers in the native chain (decode_layer.c) run its
        norms already; the final norm joins them only for a GGUF file's kept blocks (the default
        model on a CPU without AVX-512 BF16, where a decode run then steps in C): a dense float32
        model keeps torch's final norm, which the equality tests against Hugging Face use."""
        weight, norm = self.model.embed_tokens.weight, self.model.norm
        if not (_is_native_final_dtype(self.model, self.layers) and weight.dim() == 2 and weight.is_contiguous()
                and token_ids.dtype == torch.int64 and token_ids.is_contiguous()):
            return None
        return self.layers.run_step(token_ids, weight, norm.weight, norm.eps)


class NativeDecodeRun:
    """Decode steps of the same rows, one after another, each row one sequence's one token (the
    steps of a decode run and the steps computed ahead of their plans, worker/decode_run.py): what
    forward + compute_logits give for such a step, as NativeDecodeStep.final_hidden and the LM head
    compute it, with everything but the rows' tokens and positions kept between steps. The step's
    input tensors, the layers' structure (DecodeLayers over those tensors), the hidden states and
    the logits are made once, and the LM head's kernel is picked once (ParallelLMHead.bound_forward),
    so a step is two native calls and a few writes. Built per run rather than per step, this saves
    the building of the step's input, the model's and the head's Python and their allocations:
    about 0.44 ms of a 9.4 ms step at one sequence of SmolLM2 in bfloat16 on a 2-core AMD EPYC, their
    objects all out of the CPU caches after each step's weights (bench/forward_ab.py does not see
    it; the worker's decode runs do). The same kernels in the same order, so the same bits."""

    def __init__(self, model, step: NativeDecodeStep, token_ids: torch.Tensor, positions: np.ndarray,
                 slots: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, tables: list[list[int]],
                 block_size: int) -> None:
        self.model = model
        self.token_ids = token_ids
        # set_rows writes each step's values through memoryviews of these arrays: an item set through
        # numpy's scalar path costs twice as much with the CPU caches cold after a step's weights
        self._tokens, self._positions, self._slots, self._seq_lens = (
            memoryview(array) for array in (token_ids.numpy(), positions, slots, seq_lens))
        self._block_tables = block_tables  # [rows, max_blocks]: what DecodeLayers reads the tables from
        self._row_arrays = (positions, slots, seq_lens, block_tables)
        self.tables, self.block_size = tables, block_size
        self._table_lens = np.array([len(table) for table in tables], dtype=np.int64)
        self._limit = model.max_positions  # the rotary table's length, fixed with the model
        self.max_blocks = block_tables.shape[1]
        weight = model.embed_tokens.weight
        self.hidden = torch.empty(token_ids.shape[0], weight.shape[1], dtype=weight.dtype)
        self._layers = step.layers.bound_step(token_ids, weight, model.norm.weight, model.norm.eps, self.hidden)
        bound = model.lm_head.bound_forward(self.hidden)
        self._head, self.logits = bound if bound is not None else (None, None)  # None: compute_logits

    @classmethod
    def for_rows(cls, model, kv_caches, tables: list[list[int]], block_size: int) -> "NativeDecodeRun | None":
        """The run for rows whose sequences hold these block tables, or None where a step of them would
        not take NativeDecodeStep.final_hidden (forward then computes each step)."""
        num_rows, num_blocks = len(tables), kv_caches[0][0].shape[0]
        weight, norm = model.embed_tokens.weight, model.norm
        if not (weight.dtype == norm.weight.dtype == model.rotary.cos_sin.dtype
                and weight.dtype in (torch.bfloat16, torch.float32) and weight.dim() == 2 and weight.is_contiguous()):
            return None  # final_hidden's conditions (checked first: they rule out a whole model)
        if model.lora_active or model.tp.world_size != 1 or not num_rows or not all(tables) \
                or not all(0 <= block < num_blocks for table in tables for block in table):
            return None  # a block outside the pool: the full step raises its PlanError
        # room for every block a sequence can have, so that a table that grows keeps its row (grow)
        width = max(max(map(len, tables)), -(-model.max_positions // block_size))
        block_tables = np.zeros((num_rows, width), dtype=np.int32)
        for row, table in enumerate(tables):
            block_tables[row, :len(table)] = table
        positions, slots = np.zeros(num_rows, dtype=np.int64), np.zeros(num_rows, dtype=np.int64)
        seq_lens = np.ones(num_rows, dtype=np.int32)
        metadata = AttentionMetadata(
            positions=torch.from_numpy(positions), slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(block_tables), seq_lens=torch.from_numpy(seq_lens),
            query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32),
            logits_indices=torch.arange(num_rows))
        metadata.step_plans["positions_below"] = model.max_positions  # set_rows checks each step's
        step = NativeDecodeStep.for_step(model, metadata, kv_caches)
        if step is None or not _is_native_final_dtype(model, step.layers):
            return None  # a dense float32 model: forward keeps torch's final norm (final_hidden)
        return cls(model, step, torch.zeros(num_rows, dtype=torch.int64), positions, slots, seq_lens,
                   block_tables, [list(table) for table in tables], block_size)

    def can_grow(self, row: int, table: list[int], num_blocks: int) -> bool:
        """Whether `table` is row's kept table followed by more blocks, all in the pool of num_blocks."""
        kept = self.tables[row]
        return (len(kept) < len(table) <= self.max_blocks and table[:len(kept)] == kept
                and all(0 <= block < num_blocks for block in table[len(kept):]))

    def grow(self, row: int, table: list[int]) -> None:
        """Row's sequence now holds `table`: its kept table followed by more blocks (can_grow)."""
        kept = self.tables[row]
        self._block_tables[row, len(kept):len(table)] = table[len(kept):]
        self.tables[row] = list(table)
        self._table_lens[row] = len(table)

    def set_rows(self, token_ids: list[int], positions: list[int]) -> bool:
        """The next step's token and position of each row; False, having changed nothing the step
        reads, when a position is outside the row's blocks or the rotary table (forward then
        computes the step, and raises what it raises)."""
        block_size, limit = self.block_size, self._limit
        for table, position in zip(self.tables, positions):
            if not 0 <= position < min(limit, len(table) * block_size):
                return False
        for row, (table, token, position) in enumerate(zip(self.tables, token_ids, positions)):
            self._tokens[row] = token
            self._positions[row] = position
            self._slots[row] = table[position // block_size] * block_size + position % block_size
            self._seq_lens[row] = position + 1
        return True

    def bind_steps(self, greedy):
        """Several steps in one native call (ops.bound_decode_run_steps: set_rows, step and `greedy`,
        BoundGreedy over self.logits, one step after another in C), or None where it does not make
        these calls."""
        if self._head is None:
            return None
        return ops.bound_decode_run_steps(self._layers, self._head, greedy, self._row_arrays, self._table_lens,
                                          self.block_size, self._limit)

    def step(self) -> torch.Tensor:
        """The logits [rows, vocab] of the step set_rows set: self.logits, where the head's kernel is
        bound, else a new tensor; IndexError when a token id is outside the embedding table."""
        self._layers()
        if self._head is not None:
            self._head()
            return self.logits
        return self.model.compute_logits(self.hidden)
