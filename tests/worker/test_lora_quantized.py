"""LoRA adapters on quantized bases: the delta is added after the quantized projection, exactly.

With the float32 reference kernels, an int8/int4 runner serving a mixed batch (base + two
adapters) gives the greedy tokens of a float32 runner whose base weights are the dequantized
values, serving the same batch with the same adapters.
"""

from __future__ import annotations

import pytest
from tiny_models import MAX_NEW_TOKENS, make_prompts
from gguf_fixtures import gguf_model  # noqa: F401 (fixture)
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.adapters.lora_config import LoraConfig
from pagedserve.adapters.peft_folder import folder_digest
from pagedserve.contracts.step_plan import LoraLoad
from pagedserve.kernels import ops
from pagedserve.testing.lora_adapters import build_peft_adapter, greedy, merged_model
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.quantization.linear import QuantizableLinear
from pagedserve.worker.quantization.quantizers import QuantizationConfig, quantize

NAME = "llama-gqa-untied"
LORA = LoraConfig(max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def loads(checkpoint_dir, tmp_path_factory):
    base = checkpoint_dir(NAME)
    folders = [build_peft_adapter(base, tmp_path_factory.mktemp(f"q-adapter{i}"), seed=500 + i) for i in range(2)]
    return [LoraLoad(i, f"q{i}", str(folder), folder_digest(folder)) for i, folder in enumerate(folders)]


def _mixed_batch(runner: ModelRunner, loads, *, base_only: bool = False) -> list[list[int]]:
    """Six prompts: base, adapter 0, adapter 1, base, ... (all base with base_only)."""
    runner.init_cache(96, 0)
    driver = PlanDriver(runner, 96)
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS,
                      lora_slot=-1 if base_only else (i % 3) - 1)
            for i, prompt in enumerate(make_prompts(seed=41, lengths=(6, 17, 30, 45, 12, 64)))]
    driver.run_to_completion(seqs, token_budget=64, lora_loads=loads)
    return [seq.generated for seq in seqs]


@pytest.mark.parametrize("method,group_size", [("int8", None), ("int4", 32)])
def test_quantized_base_with_adapters_equals_dequantized_float32(method, group_size, checkpoint_dir, loads,
                                                                 monkeypatch):
    path = checkpoint_dir(NAME)
    dense = ModelRunner(path, device="cpu", dtype="float32", block_size=16, lora=LORA)
    dense.load()
    config = QuantizationConfig(method, group_size)
    for module in dense.model.modules():
        if isinstance(module, QuantizableLinear):
            module.weight.data = quantize(module.weight.data, config).dequantize()
    expected = _mixed_batch(dense, loads)
    base_only = _mixed_batch(dense, [], base_only=True)
    assert [expected[i] == base_only[i] for i in range(6)] == [True, False, False, True, False, False]
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    quantized = ModelRunner(path, device="cpu", dtype="float32", block_size=16, quantization=method,
                            quantization_group_size=group_size, lora=LORA)
    quantized.load()
    assert _mixed_batch(quantized, loads) == expected


def test_gguf_quantized_base_with_adapter_equals_merged_transformers(gguf_model, tmp_path, monkeypatch):
    """A GGUF's Q4/Q5/Q8 layers kept quantized (--quantization auto, reference kernels) plus an
    adapter trained on transformers' view of the same GGUF: the greedy tokens of peft's merge."""
    from gguf_fixtures import GGUF_FILE

    folder = gguf_model("llama-mixed")
    adapter = build_peft_adapter(folder, tmp_path / "adapter", seed=700, gguf_file=GGUF_FILE)
    reference = merged_model(folder, adapter, gguf_file=GGUF_FILE)
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    runner = ModelRunner(folder / GGUF_FILE, device="cpu", dtype="float32", block_size=16, quantization="auto",
                         lora=LORA)
    runner.load()
    runner.init_cache(96, 0)
    driver = PlanDriver(runner, 96)
    prompts = make_prompts(seed=43, lengths=(7, 30))
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, lora_slot=0)
            for i, prompt in enumerate(prompts)]
    driver.run_to_completion(seqs, lora_loads=[LoraLoad(0, "g", str(adapter), folder_digest(adapter))])
    assert [seq.generated for seq in seqs] == [greedy(reference, prompt, MAX_NEW_TOKENS) for prompt in prompts]
