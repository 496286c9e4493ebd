"""The real model with an adapter: SmolLM2-135M-Instruct (its cached GGUF, dequantized to float32)
plus a rank-8 PEFT adapter on all seven projections of its 30 layers gives the greedy tokens, and
nearly the logits, of peft's merge_and_unload() on transformers' view of the same file (the weights
its GGUF loader reads, saved once per session as a plain folder: the smollm2_hf_folder fixture)."""

from __future__ import annotations

import torch
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.adapters.lora_config import LoraConfig
from pagedserve.adapters.peft_folder import folder_digest
from pagedserve.checkpoints.resolve import resolve_model
from pagedserve.contracts.step_plan import LoraLoad, SampleSpec, ScheduledSeq
from pagedserve.frontend.tokenization.tokenizer import load_tokenizer
from pagedserve.testing.lora_adapters import build_peft_adapter, greedy, merged_model
from pagedserve.worker.model_input import build_model_input
from pagedserve.worker.model_runner import ModelRunner

QUESTION = "Write one sentence about lighthouses."
MAX_NEW_TOKENS = 12
NUM_BLOCKS = 8


def test_smollm2_with_an_adapter_equals_the_merged_model(tmp_path, smollm2_hf_folder):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # two matmul threads on two shared cores stall each other
    try:
        path = resolve_model("smollm2")
        tokenizer = load_tokenizer(path)
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
        adapter = build_peft_adapter(smollm2_hf_folder, tmp_path / "adapter", seed=900, b_std=0.02)
        reference = merged_model(smollm2_hf_folder, adapter)
        expected = greedy(reference, prompt, MAX_NEW_TOKENS)
        with torch.no_grad():
            expected_logits = reference(torch.tensor([prompt])).logits[0, -1]
        del reference

        runner = ModelRunner(path, device="cpu", dtype="float32", block_size=16, lora=LoraConfig(max_lora_rank=8))
        runner.load()
        runner.init_cache(NUM_BLOCKS, 0)
        load = LoraLoad(0, "smol", str(adapter), folder_digest(adapter))
        seq = DrivenSeq(seq_id=0, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, lora_slot=0)
        PlanDriver(runner, NUM_BLOCKS).run_to_completion([seq], lora_loads=[load])
        assert seq.generated == expected
        # the adapter changes the answer: the base model (its greedy tokens equal transformers',
        # test_gguf_smollm2.py) answers otherwise
        base = DrivenSeq(seq_id=2, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
        PlanDriver(runner, NUM_BLOCKS).run_to_completion([base])
        assert base.generated != expected

        scheduled = [ScheduledSeq(1, prompt, 0, list(range(-(-len(prompt) // 16))), SampleSpec(), lora_slot=0)]
        inputs = build_model_input(scheduled, block_size=16, num_blocks=NUM_BLOCKS, max_positions=2048,
                                   device=torch.device("cpu"))
        runner.lora.rows_for_step(scheduled)
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner.model(inputs.token_ids, inputs.metadata, runner.cache.gpu_cache))
        runner.lora.clear_step()
        difference = (logits[0] - expected_logits).abs().max().item()
        assert difference < 2e-3, difference
    finally:
        torch.set_num_threads(previous)
