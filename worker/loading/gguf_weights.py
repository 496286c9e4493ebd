"""Loads a GGUF model's tensors into our model, per rank, dequantized to the serving dtype.

The model lists the slices this rank needs under Hugging Face names (`checkpoint_slices`, as for
safetensors); each name maps to llama.cpp's:

    model.embed_tokens.weight                      token_embd.weight
    model.layers.N.input_layernorm.weight          blk.N.attn_norm.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.*      blk.N.attn_{q,k,v,output}.*
    model.layers.N.post_attention_layernorm.weight blk.N.ffn_norm.weight
    model.layers.N.mlp.{gate,up,down}_proj.*       blk.N.ffn_{gate,up,down}.*
    model.norm.weight                              output_norm.weight
    lm_head.weight                                 output.weight (absent when tied)

Only this rank's rows (or block-aligned columns) are read from the memory-mapped file, then
decoded with gguf.quants.dequantize, or, with keep_quantized (--quantization auto), a linear
layer whose slices are all Q4_0, Q4_1 or Q8_0 blocks keeps them as the file has them, codes and
float16 scales and minimums, without a dense weight (pagedserve.worker.quantization.linear.pack_parts
-> kernels.linear.block_quant.BlockQuantWeight); the LM head keeps its weight's blocks beside its
dense weight (`_keep_lm_head_blocks`). Everything else (embeddings, norms, K-quants and float
tensors) is dequantized to the serving dtype. llama.cpp's converter permutes the rows of the Llama q and k
weights (and biases) within each head, from Hugging Face's "rotate half" pair layout (i, i + d/2)
to interleaved pairs (2i, 2i + 1); `unpermute_rows` restores the original order, as transformers'
GGUF loader does. Qwen2 files are not permuted.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from pagedserve.kernels.ops import BlockQuantWeight
from pagedserve.checkpoints.gguf_config import GGUFConfig, config_from_reader, find_gguf_file, open_gguf
from pagedserve.worker.quantization.gguf_blocks import GGUFBlocks, to_int4_groups, to_int8_groups
from pagedserve.worker.loading.hf_checkpoint import CheckpointError, _check_filled, _names
from pagedserve.worker.layers.parallel import TensorSlice
from pagedserve.worker.quantization.quantizers import QuantizedWeight
from pagedserve.worker.quantization.linear import QuantizableLinear, pack_parts

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_LAYER_PATTERN = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
PERMUTED_ARCHITECTURES = ("llama", "mistral")  # convert_hf_to_gguf permutes q/k rows for these


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for one of our checkpoint (Hugging Face) tensor names."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_PATTERN.fullmatch(hf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise CheckpointError(f"no GGUF tensor corresponds to {hf_name}")
    layer, module, kind = match.groups()
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def unpermute_rows(num_rows: int, head_size: int) -> np.ndarray:
    """Row order undoing llama.cpp's q/k permutation on whole heads: result[r] = stored row index.

    Stored row (h, 2i + j) of head h holds the original row (h, j * d/2 + i), j in {0, 1}."""
    if num_rows % head_size or head_size % 2:
        raise CheckpointError(f"{num_rows} q/k rows do not split into heads of {head_size}")
    half = head_size // 2
    within = np.arange(head_size)  # original position p = j * half + i
    stored = 2 * (within % half) + within // half  # its stored position 2i + j
    return (np.arange(num_rows // head_size)[:, None] * head_size + stored[None, :]).reshape(-1)


class GGUFCheckpoint:
    """An open GGUF file: its config, and any slice of a tensor as undecoded `GGUFBlocks`."""

    def __init__(self, path: str | Path) -> None:
        self.file = find_gguf_file(path)
        self._reader = open_gguf(path)
        self.config: GGUFConfig = config_from_reader(self._reader, self.file)
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self._head_size = int(self.config.hf_config["head_dim"])

    @property
    def tensor_names(self) -> set[str]:
        return set(self._tensors)

    def read(self, piece: TensorSlice) -> GGUFBlocks:
        """The rows (dim 0) or columns (dim 1) a slice names, q/k rows back in Hugging Face order."""
        name = gguf_tensor_name(piece.checkpoint_name)
        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dim first
        if shape != piece.checkpoint_shape:
            raise CheckpointError(f"{name} has shape {list(shape)}, the model config implies "
                                  f"{list(piece.checkpoint_shape)}")
        blocks = GGUFBlocks.of_tensor(tensor)
        if piece.dim == 1:
            return blocks.columns(piece.src_start, piece.length)
        if self._is_permuted(name):
            if piece.src_start % self._head_size:
                raise CheckpointError(f"{name}: rows from {piece.src_start} do not start a head")
            return blocks.take_rows(piece.src_start + unpermute_rows(piece.length, self._head_size))
        return blocks.rows(piece.src_start, piece.length)

    def _is_permuted(self, gguf_name: str) -> bool:
        return self.config.architecture in PERMUTED_ARCHITECTURES and (".attn_q." in gguf_name
                                                                      or ".attn_k." in gguf_name)


def quantized_weight_of(blocks: GGUFBlocks) -> QuantizedWeight | None:
    """Q4_0/Q4_1 blocks as 4-bit groups, Q8_0 as 8-bit groups; None for any other type."""
    if blocks.tensor_type in ("Q4_0", "Q4_1"):
        groups = to_int4_groups(blocks)
        return QuantizedWeight(4, groups.values, groups.scales, groups.mins, groups.group_size)
    if blocks.tensor_type == "Q8_0":
        groups = to_int8_groups(blocks)
        return QuantizedWeight(8, groups.values, groups.scales, None, groups.group_size)
    return None


def _load_packed(model: torch.nn.Module, checkpoint: GGUFCheckpoint, slices: list[TensorSlice]) -> tuple[set[str], int]:
    """Packs every linear layer whose slices are all Q4_0/Q4_1/Q8_0; returns the dense parameter
    names it replaced and the bytes of blocks read."""
    pieces_by_param: dict[str, list[TensorSlice]] = defaultdict(list)
    for piece in slices:
        if piece.param_name.endswith(".weight"):
            pieces_by_param[piece.param_name].append(piece)
    replaced: set[str] = set()
    num_bytes = 0
    for param_name, pieces in pieces_by_param.items():
        module = model.get_submodule(param_name.rsplit(".", 1)[0])
        if not isinstance(module, QuantizableLinear):
            continue  # embeddings and the LM head stay dense
        blocks = [checkpoint.read(piece) for piece in sorted(pieces, key=lambda piece: piece.dst_start)]
        parts = [quantized_weight_of(block) for block in blocks]
        if any(part is None for part in parts):
            continue  # a float or K-quant part (or columns cut inside a block): dequantized below
        module.set_packed_weight(pack_parts(parts))
        replaced.add(param_name)
        num_bytes += sum(block.num_bytes for block in blocks)
    return replaced, num_bytes


def _keep_lm_head_blocks(model: torch.nn.Module, checkpoint: GGUFCheckpoint, slices: list[TensorSlice]) -> None:
    """Gives the LM head its weight's Q4_0/Q4_1/Q8_0 blocks as the file has them (the token
    embedding's when tied), for the decode steps' few rows (ParallelLMHead.forward); the dense
    weight stays for the embedding lookup and larger batches. Nothing when the blocks would not
    cover the head's rows exactly (a padded vocabulary shard) or the file has another type."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "set_blocks"):
        return
    param_name = next((name for name, param in model.named_parameters() if param is head.weight), None)
    pieces = sorted((piece for piece in slices if piece.param_name == param_name and piece.dim == 0),
                    key=lambda piece: piece.dst_start)
    if not pieces:
        return
    parts = [quantized_weight_of(checkpoint.read(piece)) for piece in pieces]
    if any(part is None for part in parts) or not all(part.has_format_of(parts[0]) for part in parts):
        return
    packed = pack_parts(parts)
    if isinstance(packed, BlockQuantWeight) and packed.out_features == head.weight.shape[0]:
        head.set_blocks(packed)


def _packed_names(model: torch.nn.Module, replaced: set[str]) -> set[str]:
    """The parameters (weight_*) that hold the packed form of the replaced dense weights."""
    names = set()
    for param_name in replaced:
        module_name = param_name.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        names |= {f"{module_name}.{name}" for name, _ in module.named_parameters(recurse=False)
                  if name.startswith("weight_")}
    return names


def load_gguf_weights(model: torch.nn.Module, path: str | Path, *, keep_quantized: bool = False) -> int:
    """Fills every parameter of `model` from a GGUF file (or a folder holding one); returns the
    bytes of blocks read. `model` provides checkpoint_slices() as for safetensors. keep_quantized:
    linear layers stored as Q4_0/Q4_1/Q8_0 are packed for the quantized kernels (module doc)."""
    checkpoint = GGUFCheckpoint(path)
    slices = model.checkpoint_slices()
    expected = {gguf_tensor_name(piece.checkpoint_name) for piece in slices}
    missing = expected - checkpoint.tensor_names
    if missing:
        raise CheckpointError(f"GGUF file is missing {len(missing)} tensor(s): {_names(missing)}")
    unexpected = checkpoint.tensor_names - expected
    if unexpected:
        raise CheckpointError(f"GGUF file has {len(unexpected)} unexpected tensor(s): {_names(unexpected)}")
    replaced, num_bytes = _load_packed(model, checkpoint, slices) if keep_quantized else (set(), 0)
    params = {name: param for name, param in model.named_parameters() if name not in _packed_names(model, replaced)}
    slices = [piece for piece in slices if piece.param_name not in replaced]
    filled: dict[str, int] = defaultdict(int)
    with torch.no_grad():
        for piece in slices:
            if piece.param_name not in params:
                raise CheckpointError(f"internal mapping names unknown parameter {piece.param_name}")
            blocks = checkpoint.read(piece)
            values = torch.from_numpy(blocks.dequantize())  # float32 [rows, cols]
            if len(piece.checkpoint_shape) == 1:
                values = values.reshape(-1)  # [rows]
            params[piece.param_name].narrow(piece.dim, piece.dst_start, piece.length).copy_(values)
            filled[piece.param_name] += piece.length
            num_bytes += blocks.num_bytes
    _check_filled(model, slices, params, filled)
    if keep_quantized:
        _keep_lm_head_blocks(model, checkpoint, model.checkpoint_slices())
    return num_bytes
