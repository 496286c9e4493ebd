"""Loads a Hugging Face checkpoint folder (config.json + safetensors) into our model, per rank.

The model lists every tensor slice this rank needs (`checkpoint_slices`); the loader finds the
file holding each tensor (model.safetensors.index.json for sharded checkpoints, else every
*.safetensors file in the folder), reads just that slice with safe_open(...).get_slice, converts
the dtype and copies it into place. Before reading anything it checks the checkpoint against the
model and raises `CheckpointError` naming missing tensors, unexpected tensors and shape mismatches.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.cpu_features import cpu_auto_dtype
from pagedserve.checkpoints.gguf_config import is_gguf
from pagedserve.worker.layers.parallel import TensorSlice, VocabParallelEmbedding

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
MAX_NAMES_IN_ERROR = 8


class CheckpointError(ValueError):
    pass


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's torch_dtype on CUDA; on CPU bfloat16 where the cores compute it
    natively (pagedserve.cpu_features), else float32; otherwise the dtype named."""
    name = _DTYPE_ALIASES.get(requested, requested)
    if name == "auto":
        if device.type != "cuda":
            return DTYPES[cpu_auto_dtype()]
        name = _DTYPE_ALIASES.get(str(checkpoint_dtype), str(checkpoint_dtype)).removeprefix("torch.")
        return DTYPES.get(name, torch.float32)
    if name not in DTYPES:
        raise CheckpointError(f"dtype must be auto, {', '.join(DTYPES)}; not {requested!r}")
    return DTYPES[name]


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no weight_map")
        files = {name: folder / file_name for name, file_name in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{index_path} names {path.name}, which is not in {folder}")
        return files
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{folder} has no *.safetensors files (other weight formats are not supported)")
    files = {}
    for path in paths:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                files[name] = path
    return files


def _names(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - MAX_NAMES_IN_ERROR} more" if len(names) > MAX_NAMES_IN_ERROR else ""
    return ", ".join(names[:MAX_NAMES_IN_ERROR]) + more


def _check(slices: list[TensorSlice], files: dict[str, Path], is_ignorable) -> None:
    expected = {piece.checkpoint_name for piece in slices}
    missing = expected - files.keys()
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {_names(missing)}")
    unexpected = {name for name in files.keys() - expected if not is_ignorable(name)}
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {_names(unexpected)}")


def load_weights(model: torch.nn.Module, folder: str | Path, *, keep_quantized: bool = False) -> int:
    """Fills every parameter of `model` from the checkpoint in `folder`; returns the bytes read.

    `model` provides checkpoint_slices() and is_ignorable_checkpoint_tensor(name). keep_quantized:
    a GGUF's Q4_0/Q4_1/Q8_0 linear weights are packed for the quantized kernels, not dequantized.
    """
    if is_gguf(folder):  # a .gguf file, or a folder holding one: see pagedserve.worker.loading.gguf_weights
        from pagedserve.worker.loading.gguf_weights import load_gguf_weights

        return load_gguf_weights(model, folder, keep_quantized=keep_quantized)
    slices = model.checkpoint_slices()
    files = checkpoint_files(folder)
    _check(slices, files, model.is_ignorable_checkpoint_tensor)
    params = dict(model.named_parameters())
    filled = defaultdict(int)
    by_file: dict[Path, list[TensorSlice]] = defaultdict(list)
    for piece in slices:
        if piece.param_name not in params:
            raise CheckpointError(f"internal mapping names unknown parameter {piece.param_name}")
        by_file[files[piece.checkpoint_name]].append(piece)
    num_bytes = 0
    with torch.no_grad():
        for path, pieces in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as handle:
                for piece in pieces:
                    num_bytes += _copy_slice(handle, piece, params[piece.param_name])
                    filled[piece.param_name] += piece.length
    _check_filled(model, slices, params, filled)
    return num_bytes


def _copy_slice(handle, piece: TensorSlice, param: torch.Tensor) -> int:
    source = handle.get_slice(piece.checkpoint_name)
    shape = tuple(source.get_shape())
    if shape != piece.checkpoint_shape:
        raise CheckpointError(
            f"{piece.checkpoint_name} has shape {list(shape)}, the model config implies {list(piece.checkpoint_shape)}"
        )
    index = [slice(None)] * len(shape)
    index[piece.dim] = slice(piece.src_start, piece.src_start + piece.length)
    tensor = source[tuple(index)]
    param.narrow(piece.dim, piece.dst_start, piece.length).copy_(tensor)
    return tensor.numel() * tensor.element_size()


def _check_filled(model: torch.nn.Module, slices: list[TensorSlice], params: dict[str, torch.Tensor],
                  filled: dict[str, int]) -> None:
    """Every parameter is fully covered along its sliced dimension (vocabulary padding rows excepted)."""
    padded = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, VocabParallelEmbedding)}
    dims = {piece.param_name: piece.dim for piece in slices}
    for name, param in params.items():
        if name in padded:
            continue
        if name not in dims:
            raise CheckpointError(f"parameter {name} has no source in the checkpoint mapping")
        if filled[name] != param.shape[dims[name]]:
            raise CheckpointError(f"parameter {name}: {filled[name]} of {param.shape[dims[name]]} rows loaded")
