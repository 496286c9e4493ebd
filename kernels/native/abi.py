"""What crosses the native library's C interface besides argument lists (those are
library.SIGNATURES): the dtype codes and the structures, mirrored in ctypes from
kernels/native/pagedserve_cpu.h. tests/kernels/test_native_header.py parses the header and checks
these against it (names, order, types, sizes and offsets, the latter from a probe compiled by the
system C compiler).

    DTYPE_CODES     torch dtype -> enum pagedserve_dtype (the `dtype` and `cache_dtype` arguments)
    LayerWeights    struct layer_weights: one decoder layer's weight and cache pointers and sizes
    BlockLinear     struct block_linear: a projection's GGUF blocks, for a layer that keeps them
    StepRows        struct step_rows: one decode step's rows, shared by every layer of the step
    DecodeRun       struct decode_run: a decode run's buffers and kernels, for its later steps in one call
"""

from __future__ import annotations

import ctypes

import torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # DTYPE_F32, DTYPE_BF16

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class LayerWeights(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("norm1", "norm2", "w_qkv", "b_qkv", "w_o", "b_o", "w_gate_up", "b_gate_up",
                                        "w_down", "b_down", "key_cache", "value_cache")] + [
        (name, _I64) for name in ("hidden", "num_heads", "num_kv_heads", "head_size", "inner", "num_slots",
                                  "block_size")] + [("eps", _F32), ("scale", _F32), ("cache_dtype", _I32),
                                                    ("sliding_window", _I32), ("dtype", _I32)] + [
        (name, _P) for name in ("qkv_blocks", "o_blocks", "gate_up_blocks", "down_blocks")] + [
        (name, _P) for name in ("qkv_panels", "o_panels", "gate_up_panels", "down_panels")]


class BlockLinear(ctypes.Structure):
    _fields_ = [("qs", _P), ("scales", _P), ("mins", _P), ("bits", _I64)]


class StepRows(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("cos_sin", "positions", "slot_mapping", "block_tables", "seq_lens",
                                        "query_start_loc", "seqs")] + [("num_rows", _I64), ("max_blocks", _I64)]


class DecodeRun(ctypes.Structure):
    _fields_ = [(name, _P) for name in (
        "layers", "rows", "token_ids", "embedding", "final_norm", "residual", "hidden", "spare", "scratch",
        "table_lens", "head_weight", "head_bias", "head_scales", "head_mins", "head_out32", "logits", "ids",
        "logprobs", "end_tokens", "poll", "poll_item")] + [
        (name, _I64) for name in ("num_layers", "vocab", "head_kind", "head_out", "head_in", "head_bits",
                                  "logits_vocab", "logits_stride", "logits_dtype", "num_end_tokens", "block_size",
                                  "limit")] + [
        ("eps", _F32)]


STRUCTURES = {"layer_weights": LayerWeights, "step_rows": StepRows, "block_linear": BlockLinear,
              "decode_run": DecodeRun}  # C struct name -> ctypes mirror
