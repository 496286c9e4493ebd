"""Writes a small Llama-family checkpoint folder as a GGUF file, the way llama.cpp's converter does.

For tests: a seeded checkpoint from pagedserve.checkpoints.tiny_checkpoint (config.json + model.safetensors,
optionally a tiny_tokenizer folder) becomes a GGUF with the tensor types the test picks, so GGUF
loading can be checked against transformers' own GGUF loader without downloading anything.

What convert_hf_to_gguf.py does and this repeats (independently of our loader):
  - metadata under llama.cpp's keys ({arch}.block_count, tokenizer.ggml.*, linear RoPE scaling, ...);
  - Hugging Face names renamed (model.layers.N.self_attn.q_proj.weight -> blk.N.attn_q.weight, ...);
  - for llama, the rows of q and k (weights and biases) permuted within each head from the
    "rotate half" pair layout to interleaved pairs;
  - the LM head left out when the embeddings are tied;
  - each tensor quantized with gguf.quants.quantize to the type `tensor_types` picks for it
    (1-D tensors stay F32, as llama.cpp keeps them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Container
from pathlib import Path

import numpy as np

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_RENAMES = [
    (r"^model\.embed_tokens\.", "token_embd."),
    (r"^model\.norm\.", "output_norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"blk.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blk.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.", r"blk.\1.attn_q."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.", r"blk.\1.attn_k."),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.", r"blk.\1.attn_v."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"blk.\1.attn_output."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"blk.\1.ffn_gate."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"blk.\1.ffn_up."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"blk.\1.ffn_down."),
]
# A mix of every type the loader must handle; a dict maps a GGUF name fragment to a type.
MIXED_TYPES = {"token_embd": "Q8_0", "output.": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16",
               "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "F16"}


def gguf_name(hf_name: str) -> str:
    for pattern, replacement in _RENAMES:
        renamed, count = re.subn(pattern, replacement, hf_name)
        if count:
            return renamed
    raise ValueError(f"no GGUF name for {hf_name}")


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rows (h, j * d/2 + i) -> (h, 2i + j)."""
    shape = weights.shape
    return (weights.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))


def _type_picker(tensor_types: dict[str, str] | Callable[[str], str]) -> Callable[[str], str]:
    if callable(tensor_types):
        return tensor_types

    def pick(name: str) -> str:
        for fragment, kind in tensor_types.items():
            if fragment in name:
                return kind
        return "F32"

    return pick


def write_gguf(checkpoint: str | Path, out_file: str | Path, *,
               tensor_types: dict[str, str] | Callable[[str], str] = MIXED_TYPES,
               chat_template: str | None = None, architecture: str | None = None,
               exclude: Container[str] = (), extra_metadata: dict[str, int | float] | None = None) -> Path:
    """Converts `checkpoint` (config.json, model.safetensors, optional tokenizer.json) to `out_file`.

    extra_metadata: more keys (an int as uint32, a float as float32), e.g. general.sampling.temp.
    architecture overrides general.architecture and `exclude` leaves the named GGUF tensors out
    (tests use them to write files we must refuse)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    checkpoint, out_file = Path(checkpoint), Path(out_file)
    config = json.loads((checkpoint / "config.json").read_text())
    arch = architecture or GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(out_file, arch)
    _write_metadata(writer, arch, config)
    if (checkpoint / "tokenizer.json").is_file():
        _write_tokenizer(writer, checkpoint, config)
    if chat_template:
        writer.add_chat_template(chat_template)
    for key, value in (extra_metadata or {}).items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(key, value)
    pick = _type_picker(tensor_types)
    num_heads, num_kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    for hf_name, values in sorted(load_file(checkpoint / "model.safetensors").items()):
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        name = gguf_name(hf_name)
        if name in exclude:
            continue
        values = values.astype(np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            values = llama_cpp_permute(values, num_heads if ".attn_q." in name else num_kv_heads)
        kind = gguf.GGMLQuantizationType[pick(name) if values.ndim == 2 else "F32"]
        writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def _write_metadata(writer, arch: str, config: dict) -> None:
    import gguf

    hidden, num_heads = config["hidden_size"], config["num_attention_heads"]
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or num_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_dimension_count(config.get("head_dim") or hidden // num_heads)
    writer.add_vocab_size(config["vocab_size"])
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])
    if config.get("eos_token_id") is not None:
        eos = config["eos_token_id"]
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)


def _write_tokenizer(writer, checkpoint: Path, config: dict) -> None:
    """A byte-level BPE tokenizer.json (pagedserve.checkpoints.tiny_tokenizer) as llama.cpp's "gpt2" tokenizer."""
    import gguf

    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {token["content"]: token["id"] for token in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = [None] * config["vocab_size"]
    for token, token_id in vocab.items():
        if token_id < len(tokens):
            tokens[token_id] = token
    tokens = [token if token is not None else f"[PAD{i}]" for i, token in enumerate(tokens)]
    types = [gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(True)
