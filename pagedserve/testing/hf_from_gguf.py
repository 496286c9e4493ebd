"""A plain float32 Hugging Face folder of a GGUF file's weights, as transformers' GGUF loader reads
them (tests and bench).

transformers loads a GGUF file slowly (about 13 s for SmolLM2-135M on a 2-vCPU AMD EPYC) and keeps the
loaded model unserializable; a folder of its state dict in a plain model of the same config loads
in about a second and computes with the same float32 weights. Build it once, then load the folder
wherever the reference is transformers' view of the file. `cached_hf_folder` keeps it in the
pagedserve cache beside the file's other derived files (checkpoints/gguf_cache.py), once per version
of the file and of transformers."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def build_hf_folder(gguf_path: Path, folder: Path) -> Path:
    """folder holding safetensors, config and tokenizer of the GGUF's weights dequantized by
    transformers; returns folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = model.config
    if hasattr(config, "quantization_config"):  # GGUF-loaded models refuse save_pretrained
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def cached_hf_folder(gguf_path: Path) -> Path:
    """build_hf_folder's folder for this version of the GGUF file and of transformers, built once
    into the cache (under a temporary name, then renamed into place)."""
    import transformers

    from pagedserve.checkpoints.gguf_cache import derived_folder

    folder = derived_folder(gguf_path) / f"hf-float32-transformers-{transformers.__version__}"
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".hf-float32-", dir=folder.parent))
    try:
        build_hf_folder(gguf_path, staging)
        staging.rename(folder)
    except OSError:
        if not folder.is_dir():  # not another process that finished first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
