"""What every process needs to know about a checkpoint folder, read from its JSON files (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.gguf_config import is_gguf, read_gguf_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ModelConfigError(ValueError):
    pass


@dataclass(slots=True)
class ModelInfo:
    name: str
    path: Path
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    sliding_window: int | None = None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V over all layers for one token (whole model, all KV heads)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * dtype_bytes


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def load_model_info(path: str | Path) -> ModelInfo:
    """Reads config.json (and generation_config.json for EOS ids when present), or a GGUF header."""
    if is_gguf(path):
        return _from_gguf(path)
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelConfigError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    config = json.loads(config_path.read_text())
    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else ""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    eos_ids = _as_id_list(config.get("eos_token_id"))
    generation_path = folder / "generation_config.json"
    if generation_path.is_file():
        generation = json.loads(generation_path.read_text())
        for token_id in _as_id_list(generation.get("eos_token_id")):
            if token_id not in eos_ids:
                eos_ids.append(token_id)
    num_heads = int(config["num_attention_heads"])
    hidden_size = int(config["hidden_size"])
    sliding_window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    return ModelInfo(
        name=folder.name,
        path=folder,
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_size=int(config.get("head_dim") or hidden_size // num_heads),
        hidden_size=hidden_size,
        eos_token_ids=eos_ids,
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        sliding_window=int(sliding_window) if sliding_window else None,
    )


def _from_gguf(path: str | Path) -> ModelInfo:
    """The same information from a GGUF file's metadata (see pagedserve.gguf_config)."""
    gguf = read_gguf_config(path)
    config = gguf.hf_config
    return ModelInfo(
        name=gguf.name,
        path=Path(path),
        architecture=config["architectures"][0],
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config["max_position_embeddings"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config["num_key_value_heads"]),
        head_size=int(config["head_dim"]),
        hidden_size=int(config["hidden_size"]),
        eos_token_ids=list(gguf.eos_token_ids),
        torch_dtype=config["torch_dtype"],
        sliding_window=config.get("sliding_window"),
    )
