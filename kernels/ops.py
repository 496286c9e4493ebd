"""Kernel dispatcher, the worker's one door into the kernels: Triton on CUDA; on the CPU, the
native C kernels where they take the call, plain torch otherwise.

The worker calls only this module (tests/test_import_boundaries.py enforces it), and what it needs
of the kernels besides calls (the packed weight forms, the KV cache dtype names, the native decoder
layer's structures) is re-exported here. The attention and cache signatures are those of the
references (attention/reference.py, cache/reference.py, linear/quantized_reference.py).
PAGEDSERVE_KERNELS picks the implementation:

    auto (default)   Triton when the tensors are on CUDA and triton is installed; otherwise
                     the production CPU paths: decodes through the native kernel
                     (attention/native.py) and prefill chunks through SDPA, or where the
                     native library is missing attention/sdpa.py (batched SDPA) for both;
                     cache/index_copy.py (index_copy_), and the references for the block copies
    triton           always Triton; on CPU tensors this needs TRITON_INTERPRET=1 set before the
                     kernel modules are first imported (the Triton interpreter, for tests)
    reference        always the plain-torch references (the oracle every other path is tested
                     against)

Linear layers: `linear` picks the path for a weight and its rows. Quantized weights have no Triton
kernel: on the CPU they take PyTorch's packed int8/int4 kernels or a bfloat16
dequantize-then-matmul by batch rows (linear/quantized.py), on CUDA the dequantize-then-matmul
paths (plain torch), and under `reference` the references. Dense bfloat16 CPU weights keep a
prepacked copy (`prepack_weight`): 16-column panels (linear/panels.py) where the host's measured
tuning chose them (kernels/native/tuning.py), else oneDNN's blocked layout (linear/onednn.py); a
step of one or two rows takes the native few-rows kernel on the dense weight
(linear/native_rows.py), or the panels where the tuning found them faster at one row too, more
rows the prepacked copy; other dense weights F.linear.
GGUF blocks kept as the file has them (`block_quant_linear`, linear/block_quant.py) take the native
block kernel at up to 32 rows on the CPU and an exact dequantize-then-matmul otherwise.

Per-step plans: paged_attention and write_kv_cache take an optional `step_plans` dict, owned by
the caller and shared by every layer of one step (the worker keeps it on the step's
AttentionMetadata). The CPU paths store there what they derive from the step's block tables,
lengths and slots (see attention/sdpa.py plan_sdpa_attention), so the first layer builds it and
the others reuse it; the dict must not outlive the tensors it was built from.

Fused per-layer ops (add_rms_norm, silu_mul, rotary_write_kv): the native C kernels
(layer/native.py, built by native/library.py) on CPU float32/bfloat16 tensors under `auto`;
otherwise, and whenever the native library is unavailable, their torch references
(layer/reference.py). Whole decoder layers in one native call: layer/decode_layer.py.

triton is imported lazily, on the first call that picks it, so importing this module works on a
machine without triton.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch
import torch.nn.functional as F

from pagedserve.kernels.layer import decode_run
from pagedserve.kernels.layer import native as layer_ops_native
from pagedserve.kernels.layer import reference as layer_ops_ref
from pagedserve.kernels.attention import native as paged_attention_native
from pagedserve.kernels.cache.index_copy import slot_mapping_has_padding, write_kv_cache_index_copy
from pagedserve.kernels.cache.reference import copy_blocks_ref, swap_blocks_ref, write_kv_cache_ref
from pagedserve.kernels.attention.sdpa import attend_prefills, paged_attention_sdpa, plan_sdpa_attention
from pagedserve.kernels.attention.native import (
    paged_decode_attention, paged_prefill_attention, plan_native_rows, supports_prefill,
)
from pagedserve.kernels.linear import block_quant
from pagedserve.kernels.sampling import greedy as greedy_kernel
from pagedserve.kernels.linear.packed_weights import Int8Weight
from pagedserve.kernels.attention.reference import paged_attention_ref
from pagedserve.kernels.linear.quantized import int4_linear_dequant, int8_linear_dequant, quantized_linear_by_rows
from pagedserve.kernels.linear.quantized_reference import int4_linear_ref, int8_linear_ref
from pagedserve.kernels.linear import native_rows
from pagedserve.kernels.linear.onednn import can_prepack, prepack_linear_weight, prepacked_linear
from pagedserve.kernels.linear import panels
from pagedserve.kernels.native import tuning as native_tuning

# Re-exported for the worker, which reaches the kernels only through this module: the packed weight
# forms the quantized kernels take (the worker's quantizers build them), the KV cache dtype names, and
# the native decoder layer's structures (worker/models/llama_native.py gathers each layer's tensors).
from pagedserve.kernels.linear.int4_layout import pack_int4  # noqa: F401
from pagedserve.kernels.linear.panels import PanelWeight  # noqa: F401
from pagedserve.kernels.linear.block_quant import GROUP_SIZE as BLOCK_GROUP_SIZE, BlockQuantWeight  # noqa: F401
from pagedserve.kernels.linear.packed_weights import (  # noqa: F401
    INT4_GROUP_SIZES,
    INT4_ROW_MULTIPLE,
    SCALE_DTYPE,
    Int4Weight,
    PackedWeight,
)
from pagedserve.kernels.cache.kv_dtype import resolve_kv_cache_dtype  # noqa: F401
from pagedserve.kernels.layer.decode_layer import (  # noqa: F401
    DecodeLayers,
    LayerWeights,
    chains_dense,
    decode_layer_library,
    layer_addresses,
    layer_weights,
    supports_decode_layer,
)

KERNELS_ENV = "PAGEDSERVE_KERNELS"


@cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice == "reference":
        return False
    if choice == "triton":
        return True
    if choice != "auto":
        raise ValueError(f"{KERNELS_ENV} must be auto, triton or reference, not {choice!r}")
    return device.type == "cuda" and has_triton()


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    sliding_window=None, k_scale=1.0, v_scale=1.0, step_plans: dict | None = None):
    if use_triton(query.device):
        from pagedserve.kernels.attention.triton_kernel import paged_attention as paged_attention_triton
        return paged_attention_triton(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                      scale, sliding_window, k_scale, v_scale)
    if os.environ.get(KERNELS_ENV) == "reference":
        return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                   scale, sliding_window, k_scale, v_scale)
    lib = paged_attention_native.supports(query, key_cache, value_cache)
    if lib is not None:
        return _paged_attention_native(lib, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                       scale, sliding_window, k_scale, v_scale, step_plans)
    plan = None
    if step_plans is not None:
        key = ("sdpa_attention", key_cache.shape[1], sliding_window)
        plan = step_plans.get(key)
        if plan is None:
            plan = step_plans[key] = plan_sdpa_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[1],
                                                        sliding_window)
    return paged_attention_sdpa(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                               scale, sliding_window, k_scale, v_scale, plan)


def _paged_attention_native(lib, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                            sliding_window, k_scale, v_scale, step_plans):
    """Decodes by the native kernel, prefill chunks by the native prefill kernel where it takes them
    (attention/native.py), else by SDPA (attention/sdpa.py attend_prefills)."""
    step_plans = {} if step_plans is None else step_plans
    rows = step_plans.get("native_rows")
    if rows is None:
        rows = step_plans["native_rows"] = plan_native_rows(block_tables, seq_lens, query_start_loc)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, nh, hs]
    if rows.prefills.shape[0] and not (
            supports_prefill(lib, query, key_cache)
            and paged_prefill_attention(lib, query, key_cache, value_cache, out, rows, scale * k_scale,
                                        sliding_window, v_scale)):
        key = ("sdpa_attention", key_cache.shape[1], sliding_window)
        plan = step_plans.get(key)
        if plan is None:
            plan = step_plans[key] = plan_sdpa_attention(block_tables, seq_lens, query_start_loc, key_cache.shape[1],
                                                        sliding_window)
        attend_prefills(out, query, key_cache, value_cache, plan, scale * k_scale, v_scale)
    if rows.num_seqs:
        paged_decode_attention(lib, query, key_cache, value_cache, out, rows, scale * k_scale, sliding_window,
                               v_scale)
    return out


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0,
                   step_plans: dict | None = None):
    if use_triton(key_cache.device):
        from pagedserve.kernels.cache.triton_kernel import write_kv_cache as write_kv_cache_triton
        write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    if os.environ.get(KERNELS_ENV) == "reference":
        write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    has_padding = None
    if step_plans is not None:
        has_padding = step_plans.get("slot_mapping_has_padding")
        if has_padding is None:
            has_padding = step_plans["slot_mapping_has_padding"] = slot_mapping_has_padding(slot_mapping)
    write_kv_cache_index_copy(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, has_padding)


def copy_blocks(key_caches, value_caches, block_mapping):
    if key_caches and use_triton(key_caches[0].device):
        from pagedserve.kernels.cache.triton_kernel import copy_blocks as copy_blocks_triton
        copy_blocks_triton(key_caches, value_caches, block_mapping)
        return
    copy_blocks_ref(key_caches, value_caches, block_mapping)


def swap_blocks(src_cache, dst_cache, block_mapping):
    device = dst_cache.device if dst_cache.device.type == "cuda" else src_cache.device
    if use_triton(device):
        from pagedserve.kernels.cache.triton_kernel import swap_blocks as swap_blocks_runs
        swap_blocks_runs(src_cache, dst_cache, block_mapping)
        return
    swap_blocks_ref(src_cache, dst_cache, block_mapping)


def quantized_linear(x, weight, bias=None):
    """x [M, K] @ a packed int8/int4 or a GGUF block-quantized weight [N, K] (+ bias) -> [M, N] in x's dtype."""
    if isinstance(weight, block_quant.BlockQuantWeight):
        return block_quant_linear(x, weight, bias)
    is_int8 = isinstance(weight, Int8Weight)
    if os.environ.get(KERNELS_ENV) == "reference":
        return (int8_linear_ref if is_int8 else int4_linear_ref)(x, weight, bias)
    if x.device.type == "cpu":
        return quantized_linear_by_rows(x, weight, bias)
    return (int8_linear_dequant if is_int8 else int4_linear_dequant)(x, weight, bias)


def greedy(logits) -> tuple[list[int], list[float]]:
    """logits [rows, vocab] -> per row the first index of its largest value and that token's log
    probability (kernels/sampling/greedy.py): the native kernel on the CPU, else the torch ops."""
    if os.environ.get(KERNELS_ENV) != "reference":
        lib = greedy_kernel.supports(logits)
        if lib is not None:
            return greedy_kernel.greedy_native(logits, lib)
    return greedy_kernel.greedy_ref(logits)


def block_quant_prefers(x, weight) -> bool:
    """Whether x [M, K] against GGUF blocks is better multiplied by the native block kernel than by
    a dense bfloat16 copy of the weight, where the caller holds one (the tied LM head): 4-bit blocks
    up to the kernel's exact rows (kernels/linear/block_quant.py: EXACT_ROWS), 8-bit blocks at one
    row. An 8-bit group costs the kernel as much arithmetic as a 4-bit one but carries twice the
    bytes: on SmolLM2's head (49152 x 576, Zen 4) one row took 1.34 ms against 1.46 ms dense, four
    rows 1.87 against 1.70 ms. A float32 x meets a dense float32 copy, four times the bytes of 8-bit
    blocks: the blocks at every row the kernel takes (AMD Zen 3, the same head: 2 to 6 times as fast
    from 1 to 32 rows)."""
    rows = block_quant.MAX_ROWS if x.dtype == torch.float32 else block_quant.EXACT_ROWS if weight.bits == 4 else 1
    return x.dim() == 2 and x.shape[0] <= rows and block_quant.supports(x, weight) is not None


def block_quant_linear(x, weight, bias=None):
    """x [M, K] @ GGUF blocks kept as the file has them (kernels/linear/block_quant.py): the native
    kernel at 1..block_quant.MAX_ROWS rows on the CPU (bfloat16 x: up to the host's tuned rows), the
    exact dequantize-then-matmul otherwise."""
    if os.environ.get(KERNELS_ENV) == "reference":
        return block_quant.block_quant_linear_ref(x, weight, bias)
    lib = block_quant.supports(x, weight)
    if lib is not None:
        return block_quant.block_quant_linear_native(x, weight, bias, lib)
    return block_quant.block_quant_linear_dequant(x, weight, bias)


def add_rms_norm(x, residual, weight, eps):
    """x [T, H], residual [T, H] or None (residual += x in place), weight [H] -> normalised [T, H]."""
    lib = layer_ops_native.supports_rows(x, weight)
    if lib is not None and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous())):
        return layer_ops_native.add_rms_norm(x, residual, weight, eps, lib)
    return layer_ops_ref.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up, inner):
    """gate_up [T, 2 inner] -> silu(gate) * up [T, inner]."""
    lib = layer_ops_native.supports_silu_mul(gate_up)
    if lib is not None:
        return layer_ops_native.silu_mul(gate_up, inner, lib)
    return layer_ops_ref.silu_mul(gate_up, inner)


def rotary_write_kv(qkv, cos_sin, positions, slot_mapping, key_cache, value_cache, num_heads, num_kv_heads) -> bool:
    """qkv [T, (nh + 2 kvh) hs]: when the native kernel takes these tensors, rotates the query and key
    heads in place, writes K/V into their slots and returns True; otherwise does nothing and returns
    False (the model then rotates with torch and PagedAttention writes)."""
    lib = layer_ops_native.supports_rotary_write_kv(qkv, cos_sin, key_cache)
    if lib is None:
        return False
    layer_ops_native.rotary_write_kv(qkv, cos_sin, positions, slot_mapping, key_cache, value_cache, num_heads,
                                     num_kv_heads, lib)
    return True


def linear(x, weight, bias=None, *, packed=None, prepacked=None):
    """x [M, K] @ a linear layer's weight (+ bias [N]) -> [M, N] in x's dtype, the one place that picks
    the path: `packed` (Int8Weight/Int4Weight) -> quantized_linear; else the dense weight [N, K]
    beside its copy `prepacked` (prepack_weight) -> the native few-rows kernel where it takes x and
    weight (bfloat16, up to native_rows.MAX_ROWS rows, AVX-512 BF16), the prepacked copy above
    (panels or oneDNN); panels at every row count where the host's tuning chose them for few rows
    too (tuning.panels_for_few_rows); with no prepacked copy (float32, float16, CUDA,
    PAGEDSERVE_KERNELS=reference) -> F.linear."""
    if packed is not None:
        return quantized_linear(x, packed, bias)
    if prepacked is not None:
        if isinstance(prepacked, panels.PanelWeight) and (lib := panels.library()) is not None \
                and native_tuning.panels_for_few_rows(lib):
            return panels.panel_linear(x, prepacked, bias, lib)
        lib = native_rows.supports(x, weight)
        if lib is not None:
            return native_rows.linear_rows(x, weight, bias, lib)
        if isinstance(prepacked, panels.PanelWeight):
            return panels.panel_linear(x, prepacked, bias)
        return prepacked_linear(x, prepacked, bias)
    return F.linear(x, weight, bias)


def bound_linear(x, weight, bias=None, *, packed=None, prepacked=None, out):
    """What linear(x, weight, bias, packed=, prepacked=) computes, written into out [M, N] (x's dtype,
    contiguous), as a call without arguments bound to these tensors, its path picked once as linear
    picks it for x's rows: for a loop that multiplies the same tensors again with new values in x
    (worker/decode_run.py). The same kernel and so the same bits as linear. None where linear would
    take a path without such a call (quantized or oneDNN weights, F.linear, the references, x not
    contiguous bfloat16 on the CPU): the caller then calls linear."""
    if packed is not None or prepacked is None or not (
            x.dim() == 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous()
            and out.dtype == x.dtype and out.is_contiguous() and out.shape == (x.shape[0], weight.shape[0])):
        return None
    if isinstance(prepacked, panels.PanelWeight) and (lib := panels.library()) is not None \
            and native_tuning.panels_for_few_rows(lib):
        return panels.bound_panel_linear(x, prepacked, bias, out, lib)
    lib = native_rows.supports(x, weight)
    if lib is not None:
        return native_rows.bound_linear_rows(x, weight, bias, out, lib)
    if isinstance(prepacked, panels.PanelWeight) and (lib := panels.library()) is not None:
        return panels.bound_panel_linear(x, prepacked, bias, out, lib)
    return None


def bound_block_quant_linear(x, weight, bias=None, *, out):
    """What block_quant_linear(x, weight, bias) computes, written into out [M, N] (x's dtype,
    contiguous), as a call without arguments bound to these tensors (bound_linear's use): the
    native kernel where block_quant_linear takes it, the same bits. None where it would take
    another path (the references, the dequantized product, x not contiguous)."""
    if os.environ.get(KERNELS_ENV) == "reference" or not (
            x.dim() == 2 and x.is_contiguous() and out.dtype == x.dtype and out.is_contiguous()
            and out.shape == (x.shape[0], weight.out_features)):
        return None
    lib = block_quant.supports(x, weight)
    return block_quant.bound_block_quant_linear(x, weight, bias, out, lib) if lib is not None else None


def bound_greedy(logits):
    """greedy(logits) as a call without arguments bound to logits (kernels/sampling/greedy.py
    BoundGreedy: the native kernel, its outputs allocated once), or None where greedy would take
    the torch ops: the caller then calls greedy."""
    if os.environ.get(KERNELS_ENV) == "reference":
        return None
    lib = greedy_kernel.supports(logits)
    return greedy_kernel.BoundGreedy(logits, lib) if lib is not None else None


def bound_decode_run_steps(layers_call, head, greedy, rows, table_lens, block_size: int, limit: int):
    """A decode run's later steps in one native call (kernels/layer/decode_run.py DecodeRunSteps) over
    its bound calls and kept arrays, or None where the native loop does not make these calls: the
    caller then calls them step by step."""
    if greedy is None:  # no native greedy kernel (bound_greedy: none under the reference kernels either)
        return None
    return decode_run.DecodeRunSteps.bind(greedy.lib, layers_call, head, greedy, rows, table_lens, block_size, limit)


def panels_for_few_rows() -> bool:
    """Whether layers with panels multiply them at one or two rows too (kernels/native/tuning.py)."""
    lib = panels.library()
    return lib is not None and native_tuning.panels_for_few_rows(lib)


def prepack_weight(weight):
    """The copy of weight [N, K] that linear(prepacked=...) multiplies above two rows, where one
    qualifies (bfloat16 on the CPU; not under PAGEDSERVE_KERNELS=reference): its panels
    (linear/panels.py) where the native library has the panel kernel and this host's tuning chose
    them, else oneDNN's blocked layout where torch has oneDNN's bfloat16 matmul; else None."""
    if os.environ.get(KERNELS_ENV) == "reference":
        return None
    if panels.can_pack(weight) and (lib := panels.library()) is not None \
            and native_tuning.linear_bf16_layout(lib) == "panels":
        return panels.pack(weight)
    if not can_prepack(weight):
        return None
    return prepack_linear_weight(weight)


def rotate(x, cos, sin):
    """x [T, heads, hs] rotated by RoPE rows (cos_full, sin_signed [T, 1, hs]) -> a rotated copy; torch
    (the native kernel rotates only fused with the K/V write: rotary_write_kv)."""
    return layer_ops_ref.rotate(x, cos, sin)
