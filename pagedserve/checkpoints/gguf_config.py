"""A GGUF file's header read as the config.json it stands for (no torch: the scheduler needs it too).

A GGUF model is a `.gguf` file, or a folder holding exactly one `.gguf` and no config.json. Its
metadata (llama.cpp's key names) maps onto the Hugging Face config fields our reader expects:

    general.architecture   llama | mistral | qwen2   -> architectures  (LlamaForCausalLM, ...)
    {arch}.embedding_length                          -> hidden_size
    {arch}.feed_forward_length                       -> intermediate_size
    {arch}.block_count                               -> num_hidden_layers
    {arch}.attention.head_count / head_count_kv      -> num_attention_heads / num_key_value_heads
    {arch}.attention.key_length (else hidden/heads)  -> head_dim
    {arch}.attention.layer_norm_rms_epsilon          -> rms_norm_eps
    {arch}.rope.freq_base, rope.scaling.*            -> rope_theta, rope_scaling
    {arch}.context_length                            -> max_position_embeddings
    rows of token_embd.weight                        -> vocab_size
    no output.weight tensor                          -> tie_word_embeddings
    tokenizer.ggml.bos_token_id / eos, eot, eom ids  -> bos_token_id / eos_token_id
    tokenizer.chat_template                          -> the chat template

llama.cpp writes Mistral checkpoints as `llama` (and ignores their sliding window, as we then do);
`mistral` is accepted for files that name it.

Everything is checked from the header alone, before any tensor is read: an unsupported architecture
or tensor type raises `UnsupportedGGUFError`, a truncated or corrupt file `GGUFFormatError`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

GGUF_SUFFIX = ".gguf"
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Dequantized at load with gguf.quants.dequantize (F32/F16/BF16 are plain floats).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
ROPE_FREQS_TENSOR = "rope_freqs.weight"
CONFIG_CACHE_NAME = "config-v1.json"  # bump the version when the metadata mapping changes


class GGUFError(ValueError):
    """A GGUF model that cannot be served."""


class GGUFFormatError(GGUFError):
    """Not a complete, readable GGUF file (truncated, corrupt, or a required key missing)."""


class UnsupportedGGUFError(GGUFError):
    """A well-formed GGUF file of an architecture or tensor type we do not serve."""


@dataclass(frozen=True)
class GGUFConfig:
    path: Path  # the .gguf file
    architecture: str  # as GGUF names it: llama, mistral, qwen2
    hf_config: dict  # shaped like a Hugging Face config.json
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None
    tensor_types: dict[str, str] = field(default_factory=dict)  # tensor name -> GGML type name

    @property
    def name(self) -> str:
        return self.path.stem


def find_gguf_file(path: str | Path) -> Path | None:
    """The .gguf file a model path names: the file itself, or the single .gguf of a folder without
    config.json. None when the path is not a GGUF model; GGUFFormatError when a folder holds several."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        raise GGUFFormatError(f"{path} holds {len(files)} .gguf files ({', '.join(p.name for p in files)}); "
                              f"name one of them with --model")
    return files[0] if files else None


def is_gguf(path: str | Path) -> bool:
    return find_gguf_file(path) is not None


def open_gguf(path: str | Path):
    """The model's .gguf file (memory-mapped) read as gguf.GGUFReader reads it: its `fields` and
    `tensors`, through the quick header reader (pagedserve.checkpoints.gguf_header), or GGUFReader
    itself for a file that reader leaves to it; clear errors."""
    from gguf import GGUFReader

    from pagedserve.checkpoints.gguf_header import GGUFHeader

    file = find_gguf_file(path)
    if file is None:
        raise GGUFFormatError(f"{path} is neither a .gguf file nor a folder holding one")
    with open(file, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise GGUFFormatError(f"{file} is not a GGUF file (no GGUF magic at its start)")
    try:
        try:
            reader = GGUFHeader(file)
        except (ValueError, IndexError, KeyError, OverflowError):  # a big-endian file, nested arrays, or corrupt
            reader = GGUFReader(file)  # which reads what it can, and explains what it cannot
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError) as exc:
        raise GGUFFormatError(f"{file} is truncated or corrupt ({file.stat().st_size} bytes): {exc}") from None
    file_size = file.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > file_size:
        raise GGUFFormatError(f"{file} is truncated: its tensors need {end} bytes, the file has {file_size}")
    return reader


def read_gguf_config(path: str | Path) -> GGUFConfig:
    """The config of a GGUF model (file or folder); read once per version of the file and cached."""
    file = find_gguf_file(path)
    if file is None:
        raise GGUFFormatError(f"{path} is neither a .gguf file nor a folder holding one")
    stat = file.stat()
    config = _read_cached(file.resolve(), stat.st_size, stat.st_mtime_ns)
    return dataclasses.replace(config, hf_config=copy.deepcopy(config.hf_config))


@functools.lru_cache(maxsize=4)
def _read_cached(file: Path, size: int, mtime_ns: int) -> GGUFConfig:
    """From the pagedserve cache when an earlier read left it there (see pagedserve.checkpoints.gguf_cache)."""
    from pagedserve.checkpoints.gguf_cache import derived_folder, read_json, write_json

    cache_file = derived_folder(file) / CONFIG_CACHE_NAME
    cached = read_json(cache_file)
    if cached is not None and cached.get("path") == str(file):
        try:
            return GGUFConfig(**{**cached, "path": file, "eos_token_ids": tuple(cached["eos_token_ids"])})
        except TypeError:
            pass  # written by another version: read the file again
    config = config_from_reader(open_gguf(file), file)
    write_json(cache_file, {**dataclasses.asdict(config), "path": str(file)})
    return config


def config_from_reader(reader, file: Path) -> GGUFConfig:
    metadata = _Metadata(reader, file)
    architecture = metadata.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedGGUFError(f"{file.name}: GGUF architecture {architecture!r} is not supported "
                                   f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    tensor_types = {name: t.tensor_type.name for name, t in tensors.items()}
    unsupported = sorted({kind for kind in tensor_types.values() if kind not in SUPPORTED_TENSOR_TYPES})
    if unsupported:
        names = [name for name, kind in tensor_types.items() if kind in unsupported]
        raise UnsupportedGGUFError(f"{file.name}: tensor type {', '.join(unsupported)} is not supported "
                                   f"(in {names[0]}{' and others' if len(names) > 1 else ''}; "
                                   f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    if ROPE_FREQS_TENSOR in tensors:
        raise UnsupportedGGUFError(f"{file.name}: per-dimension RoPE frequency factors ({ROPE_FREQS_TENSOR}, "
                                   f"Llama 3.1-style scaling) are not supported")
    if "token_embd.weight" not in tensors:
        raise GGUFFormatError(f"{file.name} has no token_embd.weight tensor")
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token_id = metadata.get(key, None)
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos_id = metadata.get("tokenizer.ggml.bos_token_id", None)
    hf_config = _hf_config(metadata, architecture, tensors, tensor_types, eos_ids, bos_id)
    return GGUFConfig(path=file, architecture=architecture, hf_config=hf_config, eos_token_ids=tuple(eos_ids),
                      bos_token_id=None if bos_id is None else int(bos_id),
                      chat_template=metadata.get("tokenizer.chat_template", None), tensor_types=tensor_types)


_REQUIRED = object()


class _Metadata:
    def __init__(self, reader, file: Path) -> None:
        self._fields = reader.fields
        self.file = file

    def get(self, key: str, default=_REQUIRED):
        found = self._fields.get(key)
        if found is None:
            if default is _REQUIRED:
                raise GGUFFormatError(f"{self.file.name} lacks the GGUF metadata key {key}")
            return default
        return found.contents()


def _hf_config(metadata: _Metadata, arch: str, tensors: dict, tensor_types: dict[str, str], eos_ids: list[int],
               bos_id) -> dict:
    hidden_size = int(metadata.get(f"{arch}.embedding_length"))
    num_heads = int(metadata.get(f"{arch}.attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dims = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dims != head_dim:
        raise UnsupportedGGUFError(f"{metadata.file.name}: partial rotary embedding ({rotary_dims} of "
                                   f"{head_dim} dimensions) is not supported")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes list the fastest dimension first
    num_layers = int(metadata.get(f"{arch}.block_count"))
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(metadata.get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": _serving_dtype(tensor_types),
    }
    rope_scaling = _rope_scaling(metadata, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if bos_id is not None:
        config["bos_token_id"] = int(bos_id)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in tensors
    elif arch == "mistral":
        window = metadata.get(f"{arch}.attention.sliding_window", None)
        config["sliding_window"] = int(window) if window else None
    else:
        config["use_sliding_window"] = False
    return config


def _serving_dtype(tensor_types: dict[str, str]) -> str:
    """What `--dtype auto` serves on CUDA: bfloat16 for BF16 files, float32 for all-F32 ones, else float16."""
    kinds = set(tensor_types.values())
    if "BF16" in kinds:
        return "bfloat16"
    return "float32" if kinds <= {"F32"} else "float16"


def _rope_scaling(metadata: _Metadata, arch: str) -> dict | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", None)
    factor = metadata.get(f"{arch}.rope.scaling.factor", None)
    if kind is None and metadata.get(f"{arch}.rope.scale_linear", None) is not None:
        kind, factor = "linear", metadata.get(f"{arch}.rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and float(factor or 1.0) == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(metadata.get(f"{arch}.rope.scaling.original_context_length"))}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = metadata.get(f"{arch}.rope.scaling.{key}", None)
            if value:
                scaling[name] = float(value)
        return scaling
    raise UnsupportedGGUFError(f"{metadata.file.name}: RoPE scaling type {kind!r} is not supported "
                               f"(supported: none, linear, yarn)")
