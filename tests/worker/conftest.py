"""Tiny checkpoints built per session (no model hub) and Hugging Face greedy references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from tiny_models import CHECKPOINTS, MAX_NEW_TOKENS, SIZES


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """name -> checkpoint folder, built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(tmp_path_factory.mktemp(name), **SIZES, **CHECKPOINTS[name])
        return built[name]

    return get


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


@pytest.fixture(scope="session")
def smollm2_hf_folder() -> Path:
    """The real model's GGUF (resolve_model("smollm2")) as a plain float32 Hugging Face folder of the
    weights transformers' GGUF loader reads from it, built once into the cache
    (pagedserve.testing.hf_from_gguf): the reference of the real-model tests."""
    from pagedserve.checkpoints.resolve import resolve_model
    from pagedserve.testing.hf_from_gguf import cached_hf_folder

    return cached_hf_folder(resolve_model("smollm2"))
