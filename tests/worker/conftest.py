"""Tiny checkpoints built per session (no model hub) and Hugging Face greedy references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint

VOCAB_SIZE = 512
PROMPT_LENGTHS = (1, 7, 16, 17, 33, 64, 129, 300)
MAX_NEW_TOKENS = 12
SIZES = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=128, max_position_embeddings=512)

CHECKPOINTS = {
    "llama-gqa-untied": dict(architecture="llama", tie_word_embeddings=False, seed=11),
    "qwen2-bias-tied": dict(architecture="qwen2", tie_word_embeddings=True, seed=12),
    "mistral-window-48": dict(architecture="mistral", sliding_window=48, seed=13),
    "llama3-rope-scaling": dict(architecture="llama", seed=14, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """name -> checkpoint folder, built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(tmp_path_factory.mktemp(name), **SIZES, **CHECKPOINTS[name])
        return built[name]

    return get


def make_prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist() for length in lengths]


@pytest.fixture(scope="session")
def hf_greedy(checkpoint_dir):
    """(checkpoint name, prompt tuple) -> MAX_NEW_TOKENS greedy tokens from transformers' generate."""
    models, cache = {}, {}

    def get(name: str, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in cache:
            if name not in models:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(name), dtype=torch.float32).eval()
                model.generation_config.eos_token_id = None  # always MAX_NEW_TOKENS tokens
                models[name] = model
            input_ids = torch.tensor([prompt])
            with torch.no_grad():
                output = models[name].generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                               max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
            cache[key] = output[0, len(prompt):].tolist()
        return cache[key]

    return get
