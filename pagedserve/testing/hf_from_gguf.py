"""A plain float32 Hugging Face folder of a GGUF file's weights, as transformers' GGUF loader reads
them (tests and bench).

transformers loads a GGUF file slowly (about 13 s for SmolLM2-135M on a 2-vCPU AMD EPYC) and keeps the
loaded model unserializable; a folder of its state dict in a plain model of the same config loads
in about a second and computes with the same float32 weights. Build it once, then load the folder
wherever the reference is transformers' view of the file."""

from __future__ import annotations

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
