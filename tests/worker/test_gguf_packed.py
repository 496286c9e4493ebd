"""GGUF linear weights kept quantized at load (--quantization auto): Q4_0/Q4_1/Q8_0 layers keep their
blocks exactly (codes, float16 scales and minimums), without a dense copy; everything else is
dequantized. Checked against the same file dequantized (--quantization none): the kept weights
decode to the GGUF values bit for bit, the wiring is exact under the reference kernels, and the
production kernels keep the logits and greedy tokens of the dequantized model."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_prompts
from gguf_fixtures import GGUF_FILE, gguf_model, write_all_kept  # noqa: F401 (fixture)
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.kernels import ops
from pagedserve.kernels.linear.block_quant import BlockQuantWeight
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.testing.prompt_scoring import sequence_logits
from pagedserve.worker.quantization.linear import QuantizableLinear

NUM_BLOCKS = 64
MAX_NEW_TOKENS = 10
@pytest.fixture(scope="module")
def all_kept(tmp_path_factory):
    return write_all_kept(tmp_path_factory, seed=33)


def _runner(path, quantization: str) -> ModelRunner:
    runner = ModelRunner(path, device="cpu", dtype="float32", block_size=16, quantization=quantization)
    runner.load()
    runner.init_cache(NUM_BLOCKS, 0)
    return runner


def _greedy(runner: ModelRunner) -> list[list[int]]:
    driver = PlanDriver(runner, NUM_BLOCKS)
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
            for i, prompt in enumerate(make_prompts(seed=3, lengths=(1, 17, 40, 90)))]
    driver.run_to_completion(seqs, token_budget=64)
    return [seq.generated for seq in seqs]


def _layers(runner: ModelRunner) -> dict[str, QuantizableLinear]:
    return {name: module for name, module in runner.model.named_modules() if isinstance(module, QuantizableLinear)}


def test_kept_types_are_packed_and_the_rest_dequantized(gguf_model):
    """llama-mixed: q Q4_0, k Q4_1, v F16 (the fused qkv layer is dequantized), o Q8_0, gate Q4_1,
    up Q4_0, down F16."""
    path = gguf_model("llama-mixed") / GGUF_FILE
    kept, dense = _runner(path, "auto"), _runner(path, "none")
    kinds = {name.split(".", 2)[-1]: type(layer.packed).__name__ for name, layer in _layers(kept).items()}
    assert kinds == {"self_attn.qkv_proj": "NoneType", "self_attn.o_proj": "BlockQuantWeight",
                     "mlp.gate_up_proj": "BlockQuantWeight", "mlp.down_proj": "NoneType"}
    for name, layer in _layers(kept).items():
        assert (layer.weight is None) == (layer.packed is not None), name
    assert all(layer.packed is None for layer in _layers(dense).values())
    assert kept.num_weight_bytes < dense.num_weight_bytes


def test_kept_weights_decode_to_the_gguf_values_bit_for_bit(all_kept):
    kept, dense = _runner(all_kept, "auto"), _runner(all_kept, "none")
    dense_layers = _layers(dense)
    for name, layer in _layers(kept).items():
        expected = dense_layers[name].weight  # the GGUF blocks decoded by gguf.quants.dequantize
        assert isinstance(layer.packed, BlockQuantWeight), name
        assert layer.packed.bits == (8 if name.endswith("o_proj") else 4), name
        assert layer.packed.scales.dtype == torch.float16, name
        assert torch.equal(layer.packed.dequantize(), expected), name


def test_wiring_is_exact_under_the_reference_kernels(all_kept, monkeypatch):
    """With the float32 dequantize-then-matmul kernels, the packed model is the float32 model that
    holds the packed weights' values: same logits, same greedy tokens."""
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    kept = _runner(all_kept, "auto")
    expected = _runner(all_kept, "none")
    dense_layers = _layers(expected)
    for name, layer in _layers(kept).items():
        dense_layers[name].weight.data = layer.packed.dequantize()
    prompt = make_prompts(seed=4, lengths=(70,))[0]
    torch.testing.assert_close(sequence_logits(kept, prompt), sequence_logits(expected, prompt), rtol=1e-4,
                               atol=1e-4)
    assert _greedy(kept) == _greedy(expected)


def test_production_kernels_keep_the_dequantized_models_logits_and_greedy_tokens(all_kept):
    """The block kernels multiply float32 activations by the exact weights: the float32 logits of
    the dequantized model up to the order of float32 sums, and the same greedy tokens."""
    kept, dense = _runner(all_kept, "auto"), _runner(all_kept, "none")
    for prompt in make_prompts(seed=4, lengths=(96, 40)):
        torch.testing.assert_close(sequence_logits(kept, prompt), sequence_logits(dense, prompt), rtol=1e-4,
                                   atol=1e-4)
    assert _greedy(kept) == _greedy(dense)


@pytest.mark.parametrize("model", ["all-kept", "qwen2-tied"])
def test_lm_head_keeps_the_files_blocks_and_takes_them_in_float32(all_kept, gguf_model, model, monkeypatch):
    """The LM head keeps its Q8_0 blocks (the token embedding's when tied) beside the dense weight
    the embedding needs; float32 rows go through the block kernel at every row count it takes (a
    dense float32 copy reads four times the bytes), which gives the dense float32 product up to the
    order of sums; `none` keeps no blocks."""
    path = all_kept if model == "all-kept" else gguf_model(model) / GGUF_FILE
    kept, dense = _runner(path, "auto"), _runner(path, "none")
    head = kept.model.lm_head
    assert head.is_tied == (model == "qwen2-tied")
    assert isinstance(head.blocks, BlockQuantWeight) and head.blocks.bits == 8
    assert torch.equal(head.blocks.dequantize(), head.weight)  # float32: the file's values both ways
    assert dense.model.lm_head.blocks is None
    calls = []
    block_linear = ops.block_quant_linear
    monkeypatch.setattr(ops, "block_quant_linear", lambda *args: calls.append(args) or block_linear(*args))
    for rows in (1, 4):
        hidden = torch.randn(rows, head.weight.shape[1], generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(head(hidden), torch.nn.functional.linear(hidden, head.weight)[:, :head.vocab_size],
                                   rtol=1e-5, atol=1e-5)
    assert [call[0].shape[0] for call in calls] == [1, 4]
