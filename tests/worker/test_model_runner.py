"""ModelRunner with block operations in the plan (fork with copy-on-write, swap out and back in)."""

from __future__ import annotations

import pytest
from tiny_models import MAX_NEW_TOKENS, make_prompts
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan
from pagedserve.worker.model_input import PlanError
from pagedserve.worker.model_runner import ModelRunner, RunnerStateError

NAME = "llama-gqa-untied"


@pytest.fixture(scope="module")
def runner(checkpoint_dir) -> ModelRunner:
    runner = ModelRunner(checkpoint_dir(NAME), device="cpu", dtype="float32", block_size=16)
    runner.load()
    runner.init_cache(64, 16)
    return runner


def test_forked_sequence_with_copied_last_block_continues_like_its_parent(runner, hf_greedy):
    driver = PlanDriver(runner, 64)
    prompt = make_prompts(seed=3, lengths=(37,))[0]  # 3 blocks, the last one holding 5 tokens
    parent = DrivenSeq(seq_id=1, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.step([(parent, len(prompt))])
    child = DrivenSeq(seq_id=2, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
    child.tokens, child.num_computed = list(parent.tokens), parent.num_computed
    child.block_table = parent.block_table[:2] + [driver.free_blocks.pop()]  # full blocks shared
    driver.step([(parent, 1), (child, 1)], copy=[(parent.block_table[2], child.block_table[2])])
    driver.run_to_completion([parent, child])
    assert parent.generated == child.generated == hf_greedy(NAME, prompt)
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != parent.block_table[2]


def test_swapped_out_sequence_resumes_after_its_blocks_were_reused(runner, hf_greedy):
    driver = PlanDriver(runner, 64)
    first, second = make_prompts(seed=4, lengths=(50, 70))
    swapped = DrivenSeq(seq_id=1, prompt=first, max_new_tokens=MAX_NEW_TOKENS)
    other = DrivenSeq(seq_id=2, prompt=second, max_new_tokens=MAX_NEW_TOKENS)
    driver.step([(swapped, len(first))])
    driver.step([(swapped, 1)])
    device_blocks = list(swapped.block_table)
    host_blocks = list(range(3, 3 + len(device_blocks)))
    driver.free(swapped)  # preempted: its device blocks go straight to the other sequence
    driver.step([(other, len(second))], swap_out=list(zip(device_blocks, host_blocks)))
    assert set(device_blocks) & set(other.block_table)
    swapped.block_table = [driver.free_blocks.pop() for _ in host_blocks]
    assert swapped.block_table != device_blocks
    driver.step([(swapped, 1), (other, 1)], swap_in=list(zip(host_blocks, swapped.block_table)))
    driver.run_to_completion([swapped, other])
    assert swapped.generated == hf_greedy(NAME, first)
    assert other.generated == hf_greedy(NAME, second)


def test_partial_prefill_chunk_returns_no_sample_and_times_the_forward(runner):
    plan = StepPlan(step_id=1, epoch=3, seqs=[ScheduledSeq(7, [5, 6, 7], 0, [0], sample=None)])
    result = runner.execute(plan)
    assert result.samples == [] and result.step_id == 1 and result.epoch == 3
    assert result.forward_seconds > 0


def test_plan_with_too_few_blocks_is_rejected(runner):
    plan = StepPlan(step_id=1, seqs=[ScheduledSeq(7, list(range(20)), 0, [0], sample=SampleSpec())])
    with pytest.raises(PlanError, match="cannot hold"):
        runner.execute(plan)
    plan = StepPlan(step_id=1, seqs=[ScheduledSeq(7, [1], 0, [64], sample=SampleSpec())])
    with pytest.raises(PlanError, match="block ids"):
        runner.execute(plan)


def test_capacity_and_state_errors(checkpoint_dir):
    fresh = ModelRunner(checkpoint_dir(NAME), device="cpu", dtype="float32", block_size=16)
    with pytest.raises(RunnerStateError):
        fresh.profile_num_blocks()
    fresh.load()
    with pytest.raises(RunnerStateError):
        fresh.execute(StepPlan(step_id=1))
    bytes_per_block = fresh.cache_shape.bytes_per_block
    assert bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 slots, 2 KV heads of 16 floats
    assert fresh.profile_num_blocks(kv_cache_memory_gib=bytes_per_block * 10 / 2**30) == 10
    assert fresh.num_blocks_for_bytes(bytes_per_block * 3) == 3
    assert fresh.profile_num_blocks() > 0


def test_bfloat16_prepacked_weights_give_the_logits_of_the_dense_ones(checkpoint_dir, monkeypatch):
    import torch

    from pagedserve.kernels.linear.onednn import can_prepack
    from pagedserve.kernels.linear.panels import PanelWeight
    from pagedserve.worker.loading.prepacked_weights import prepack_model

    if not can_prepack(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.skip("this CPU or torch build has no oneDNN bfloat16 matmul")
    bf16 = ModelRunner(checkpoint_dir(NAME), device="cpu", dtype="bfloat16", block_size=16)
    bf16.load()
    model = bf16.model
    prepacked = [module for module in model.modules() if getattr(module, "prepacked_weight", None) is not None]
    assert len(prepacked) == 2 * len(model.layers) * 2 + 1  # qkv, o, gate_up, down per layer; the LM head
    dense_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    assert bf16.num_prepacked_bytes > 0 and bf16.num_weight_bytes == dense_bytes + bf16.num_prepacked_bytes
    bf16.init_cache(64, 0)
    prompt = make_prompts(seed=5, lengths=(21,))[0]
    seq = ScheduledSeq(seq_id=1, token_ids=prompt, start_position=0, block_table=[0, 1], sample=SampleSpec())
    from pagedserve.worker.model_input import build_model_input

    inputs = build_model_input([seq], block_size=16, num_blocks=64, max_positions=model.max_positions,
                               device=bf16.device)
    with torch.inference_mode():
        packed_logits = model.compute_logits(model(inputs.token_ids, inputs.metadata, bf16.cache.gpu_cache))
        for module in prepacked:
            module.prepacked_weight = None
        dense_logits = model.compute_logits(model(inputs.token_ids, inputs.metadata, bf16.cache.gpu_cache))
        if any(isinstance(module.prepacked_weight, PanelWeight) for module in prepacked):
            # the panels sum in another order than oneDNN: within bfloat16 rounding, same greedy tokens
            assert torch.allclose(packed_logits.float(), dense_logits.float(), rtol=0.05, atol=0.05)
            assert torch.equal(packed_logits.argmax(-1), dense_logits.argmax(-1))
        else:
            assert torch.equal(packed_logits, dense_logits)
        monkeypatch.setenv("PAGEDSERVE_KERNELS", "reference")
        assert prepack_model(model) == 0
    float32 = ModelRunner(checkpoint_dir(NAME), device="cpu", dtype="float32", block_size=16)
    float32.load()
    assert float32.num_prepacked_bytes == 0
