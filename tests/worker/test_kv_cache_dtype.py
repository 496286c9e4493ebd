"""KV-cache dtypes through ModelRunner: pool sizes, fp8 through swap and copy-on-write, agreement with
the full-precision cache."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_prompts
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.kernels import ops
from pagedserve.kernels.cache.kv_dtype import KVCacheDtypeError
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.testing.prompt_scoring import sequence_logits

NAME = "llama-gqa-untied"
NUM_BLOCKS = 64
MAX_NEW_TOKENS = 8


def _runner(checkpoint_dir, kv_cache_dtype: str, name: str = NAME) -> ModelRunner:
    runner = ModelRunner(checkpoint_dir(name), device="cpu", dtype="float32", block_size=16,
                         kv_cache_dtype=kv_cache_dtype)
    runner.load()
    runner.init_cache(NUM_BLOCKS, 16)
    return runner


def _generate(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS) for i, prompt in enumerate(prompts)]
    PlanDriver(runner, NUM_BLOCKS).run_to_completion(seqs, token_budget=128)
    return [seq.generated for seq in seqs]


def test_pool_size_follows_the_kv_dtype(checkpoint_dir):
    budget_gib = 1 / 1024
    blocks = {}
    for kv_cache_dtype in ("auto", "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"):
        runner = ModelRunner(checkpoint_dir(NAME), device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype)
        runner.load()
        blocks[kv_cache_dtype] = runner.profile_num_blocks(kv_cache_memory_gib=budget_gib)
        runner.init_cache(4, 4)
        assert runner.cache.gpu_cache[0][0].dtype == runner.kv_cache_dtype
    assert blocks["auto"] == blocks["float32"]
    assert blocks["bfloat16"] == 2 * blocks["float32"]
    assert blocks["fp8_e4m3"] == blocks["fp8_e5m2"] == 4 * blocks["float32"]


def test_bad_kv_dtype_fails_before_loading(checkpoint_dir):
    with pytest.raises(KVCacheDtypeError, match="fp8_e4m3"):
        ModelRunner(checkpoint_dir(NAME), kv_cache_dtype="int8")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_sequences_survive_swap_and_copy_on_write(checkpoint_dir, kv_cache_dtype):
    """A forked child (last block copied) and a sequence swapped out and back in continue exactly as
    an undisturbed fp8 run does: block operations move the stored bytes unchanged."""
    runner = _runner(checkpoint_dir, kv_cache_dtype)
    first, second = make_prompts(seed=4, lengths=(37, 70))
    expected = _generate(runner, [first, second])

    driver = PlanDriver(runner, NUM_BLOCKS)
    parent = DrivenSeq(seq_id=1, prompt=first, max_new_tokens=MAX_NEW_TOKENS)
    other = DrivenSeq(seq_id=2, prompt=second, max_new_tokens=MAX_NEW_TOKENS)
    driver.step([(parent, len(first)), (other, len(second))])
    child = DrivenSeq(seq_id=3, prompt=first, max_new_tokens=MAX_NEW_TOKENS)  # a fork: 2 full blocks shared
    child.tokens, child.num_computed = list(parent.tokens), parent.num_computed
    child.block_table = parent.block_table[:2] + [driver.free_blocks.pop()]
    driver.step([(parent, 1), (child, 1), (other, 1)], copy=[(parent.block_table[2], child.block_table[2])])
    device_blocks = list(other.block_table)
    host_blocks = list(range(3, 3 + len(device_blocks)))
    driver.free(other)  # preempted by swapping; a newcomer takes its device blocks at once
    filler = DrivenSeq(seq_id=4, prompt=make_prompts(seed=6, lengths=(90,))[0], max_new_tokens=1)
    driver.step([(parent, 1), (child, 1), (filler, 90)], swap_out=list(zip(device_blocks, host_blocks)))
    assert set(device_blocks) & set(filler.block_table)
    other.block_table = [driver.free_blocks.pop() for _ in host_blocks]
    driver.step([(parent, 1), (child, 1), (other, 1)], swap_in=list(zip(host_blocks, other.block_table)))
    driver.run_to_completion([parent, child, other])
    assert parent.generated == child.generated == expected[0]
    assert other.generated == expected[1]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_production_paths_store_and_read_like_the_reference(checkpoint_dir, kv_cache_dtype, monkeypatch):
    """The CPU write (index_copy_ on raw bytes) and attention (SDPA on converted K/V) give the greedy
    tokens of the reference kernels on the same narrow cache."""
    prompts = make_prompts(seed=5, lengths=(9, 33, 70))
    production = _generate(_runner(checkpoint_dir, kv_cache_dtype), prompts)
    monkeypatch.setenv(ops.KERNELS_ENV, "reference")
    assert _generate(_runner(checkpoint_dir, kv_cache_dtype), prompts) == production


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied", "mistral-window-48"])
def test_narrow_caches_agree_with_the_float32_cache(checkpoint_dir, name):
    """Teacher-forced next-token agreement over 4 prompts of 96 tokens. The tiny seeded models amplify
    K/V rounding (random weights, peaked attention), so these bounds are loose; SmolLM2's figures are
    in bench/quant_accuracy.py."""
    prompts = make_prompts(seed=4, lengths=(96,) * 4)
    logits = {kv: [sequence_logits(_runner(checkpoint_dir, kv, name), prompt, chunk_size=40) for prompt in prompts]
              for kv in ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2")}

    def top1(kv: str) -> float:
        pairs = zip(logits["float32"], logits[kv])
        return sum(float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in pairs) / len(prompts)

    assert top1("bfloat16") >= 0.95
    assert top1("fp8_e4m3") >= 0.7
    assert top1("fp8_e5m2") >= 0.55
    assert top1("fp8_e4m3") > top1("fp8_e5m2")  # one more mantissa bit
    assert torch.isfinite(torch.cat(logits["fp8_e5m2"])).all()


def test_calibrated_fp8_scales_put_the_largest_value_at_half_the_range(checkpoint_dir, monkeypatch):
    from pagedserve.kernels.cache.kv_dtype import fp8_max
    from pagedserve.testing.kv_scales import calibrate_kv_scales

    calibration = make_prompts(seed=8, lengths=(80,))[0]
    float32 = _runner(checkpoint_dir, "float32")
    maxima = []
    for layer in float32.model.layers:
        layer.self_attn.attn.register_forward_pre_hook(
            lambda module, args: maxima.append((float(args[1].abs().max()), float(args[2].abs().max()))))
    with monkeypatch.context() as patch:
        patch.setenv("PAGEDSERVE_NATIVE", "0")  # K and V pass through PagedAttention.forward (the hook)
        sequence_logits(float32, calibration)
    runner = _runner(checkpoint_dir, "fp8_e4m3")
    scales = calibrate_kv_scales(runner, calibration, margin=2.0)
    assert scales == calibrate_kv_scales(runner, calibration, margin=2.0)  # deterministic
    limit = fp8_max(torch.float8_e4m3fn)
    first_k, first_v = maxima[0]  # layer 0 sees no fp8 rounding upstream: exact
    assert scales[0] == pytest.approx((2 * first_k / limit, 2 * first_v / limit), rel=1e-6)
    assert all(k > 0 and v > 0 for k, v in scales)
    attention = runner.model.layers[1].self_attn.attn
    assert (attention.k_scale, attention.v_scale) == scales[1]
    with pytest.raises(ValueError, match="fp8"):
        calibrate_kv_scales(float32, calibration)
