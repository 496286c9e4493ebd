"""Tiny GGUF models written by the tests (pagedserve.testing.tiny_gguf) and transformers' view of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.testing.tiny_gguf import MIXED_TYPES, write_gguf
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.checkpoints.tiny_tokenizer import build_tokenizer

VOCAB_SIZE = 512
SIZES = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=128, max_position_embeddings=512)
GGUF_FILE = "model.gguf"
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"

GGUF_MODELS = {
    # every tensor type the loader must decode, Llama's q/k permutation, GQA, an untied LM head
    "llama-mixed": (dict(architecture="llama", tie_word_embeddings=False, seed=31), MIXED_TYPES),
    # QKV bias (1-D, F32), tied embeddings, no permutation
    "qwen2-tied": (dict(architecture="qwen2", tie_word_embeddings=True, seed=32),
                   {"token_embd": "Q8_0", "attn": "Q5_1", "ffn": "Q5_0"}),
}


# every linear layer in a kept type: q Q4_0 with k, v Q4_1 (one 4-bit layer), o Q8_0, gate Q4_1 with
# up Q4_0, down Q4_1; the token embedding and the untied output Q8_0
ALL_KEPT = {"token_embd": "Q8_0", "output.": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q4_1",
            "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_1"}


def write_all_kept(tmp_path_factory, seed: int) -> Path:
    """A tiny Llama GGUF whose linear layers are all kept types (ALL_KEPT)."""
    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("kept-checkpoint"), architecture="llama",
                                       vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                       intermediate_size=128, max_position_embeddings=512, seed=seed)
    return write_gguf(checkpoint, tmp_path_factory.mktemp("kept") / GGUF_FILE, tensor_types=ALL_KEPT)


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory):
    """name -> folder holding model.gguf (and nothing else), built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            options, tensor_types = GGUF_MODELS[name]
            checkpoint = tmp_path_factory.mktemp(f"{name}-checkpoint")
            build_tokenizer(checkpoint, vocab_size=VOCAB_SIZE)
            build_tiny_checkpoint(checkpoint, **SIZES, **options)
            folder = tmp_path_factory.mktemp(name)
            write_gguf(checkpoint, folder / GGUF_FILE, tensor_types=tensor_types, chat_template=CHAT_TEMPLATE)
            built[name] = folder
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_gguf_model(gguf_model):
    """name -> transformers' model loaded from the GGUF (its own dequantizing loader), float32."""
    models = {}

    def get(name: str):
        if name not in models:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            model = AutoModelForCausalLM.from_pretrained(gguf_model(name), gguf_file=GGUF_FILE,
                                                         dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # always the asked number of tokens
            models[name] = model
        return models[name]

    return get
