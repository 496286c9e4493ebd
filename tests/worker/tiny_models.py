"""The tiny checkpoints' sizes and the prompts the worker tests decode (conftest.py builds the
checkpoints). A module of its own, not conftest: `from conftest import` finds whichever test
folder's conftest was imported first when several folders are collected in one run."""

from __future__ import annotations

import torch

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


def make_prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist() for length in lengths]
