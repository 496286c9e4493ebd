"""LoRA adapters in the worker: a mixed batch (base + 3 adapters) against peft's merge_and_unload()."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import MAX_NEW_TOKENS, make_prompts
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.adapters.lora_config import LoraConfig
from pagedserve.adapters.peft_folder import AdapterError, folder_digest
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.contracts.step_plan import LoraLoad, SampleSpec, ScheduledSeq, StepPlan
from pagedserve.testing.lora_adapters import build_peft_adapter, greedy, merged_model
from pagedserve.worker.model_input import PlanError, build_model_input
from pagedserve.worker.model_runner import ModelRunner

NAME = "llama-gqa-untied"
PROMPT_LENGTHS = (5, 19, 33, 70)


@pytest.fixture(scope="module")
def adapters(checkpoint_dir, tmp_path_factory):
    base = checkpoint_dir(NAME)
    return [build_peft_adapter(base, tmp_path_factory.mktemp(f"adapter{i}"), seed=100 + i) for i in range(3)]


@pytest.fixture(scope="module")
def references(checkpoint_dir, adapters):
    base = checkpoint_dir(NAME)
    return [merged_model(base, None)] + [merged_model(base, adapter) for adapter in adapters]


def _loads(adapters, slots=(0, 1, 2)):
    return [LoraLoad(slot, f"a{i}", str(path), folder_digest(path)) for i, (slot, path) in enumerate(zip(slots, adapters))]


def _runner(path, **options) -> ModelRunner:
    runner = ModelRunner(path, device="cpu", dtype="float32", block_size=16, **options)
    runner.load()
    runner.init_cache(96, 0)
    return runner


def test_mixed_batch_of_base_and_three_adapters_matches_merged_references(checkpoint_dir, adapters, references):
    runner = _runner(checkpoint_dir(NAME), lora=LoraConfig(max_loras=3, max_lora_rank=8))
    driver = PlanDriver(runner, 96)
    prompts = make_prompts(seed=31, lengths=PROMPT_LENGTHS)
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, lora_slot=i - 1)
            for i, prompt in enumerate(prompts)]  # slot -1: the base model
    driver.run_to_completion(seqs, token_budget=48, lora_loads=_loads(adapters))
    expected = [greedy(model, prompt, MAX_NEW_TOKENS) for model, prompt in zip(references, prompts)]
    assert [seq.generated for seq in seqs] == expected
    assert len({tuple(tokens) for tokens in expected}) == 4  # the adapters do change the answers


def test_mixed_batch_logits_within_1e3_of_merged_references(checkpoint_dir, adapters, references):
    runner = _runner(checkpoint_dir(NAME), lora=LoraConfig(max_loras=3, max_lora_rank=8))
    prompts = make_prompts(seed=32, lengths=PROMPT_LENGTHS)
    seqs, next_block = [], 0
    for i, prompt in enumerate(prompts):
        blocks = -(-len(prompt) // 16)
        seqs.append(ScheduledSeq(i, prompt, 0, list(range(next_block, next_block + blocks)), sample=SampleSpec(),
                                 lora_slot=i - 1))
        next_block += blocks
    for load in _loads(adapters):
        runner.lora.load(load)
    inputs = build_model_input(seqs, block_size=16, num_blocks=96, max_positions=512, device=torch.device("cpu"))
    runner.lora.rows_for_step(seqs)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(inputs.token_ids, inputs.metadata, runner.cache.gpu_cache))
    runner.lora.clear_step()
    for row, (model, prompt) in enumerate(zip(references, prompts)):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0, -1]
        assert torch.allclose(logits[row], expected, atol=1e-3, rtol=0), (row, (logits[row] - expected).abs().max())


def test_slot_reload_and_host_cache(checkpoint_dir, adapters, references):
    """One slot swapped between adapters; max_cpu_loras keeps them in host memory (no second read)."""
    runner = _runner(checkpoint_dir(NAME), lora=LoraConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=2))
    prompt = make_prompts(seed=33, lengths=(21,))[0]
    loads = _loads(adapters, slots=(0, 0, 0))
    for round_ in range(2):
        for index in (0, 1):
            driver = PlanDriver(runner, 96)
            seq = DrivenSeq(seq_id=index, prompt=prompt, max_new_tokens=6, lora_slot=0)
            driver.run_to_completion([seq], lora_loads=[loads[index]])
            assert seq.generated == greedy(references[index + 1], prompt, 6)
    assert runner.lora.num_loads == 2 and len(runner.lora.host) == 2
    runner.lora.load(loads[2])  # a third adapter pushes the least recently used one out of host memory
    assert runner.lora.num_loads == 3 and set(runner.lora.host) == {loads[1].digest, loads[2].digest}


def test_plan_errors(checkpoint_dir, adapters, tmp_path):
    plain = _runner(checkpoint_dir(NAME))
    seq = ScheduledSeq(1, [5, 6], 0, [0], sample=SampleSpec(), lora_slot=0)
    with pytest.raises(PlanError, match="--enable-lora"):
        plain.execute(StepPlan(step_id=1, seqs=[seq]))
    runner = _runner(checkpoint_dir(NAME), lora=LoraConfig(max_loras=2, max_lora_rank=8))
    with pytest.raises(AdapterError, match="holds no adapter"):
        runner.execute(StepPlan(step_id=1, seqs=[seq]))


def test_an_adapter_that_cannot_be_loaded_fails_only_its_sequences(checkpoint_dir, adapters, references):
    """Its folder changed since it was checked (other digest): the sequences on its slot fail with
    the reason, the base sequence beside them is answered, and a later good load clears the slot."""
    runner = _runner(checkpoint_dir(NAME), lora=LoraConfig(max_loras=2, max_lora_rank=8))
    prompt = make_prompts(seed=35, lengths=(9,))[0]
    stale = LoraLoad(0, "a0", str(adapters[0]), "0" * 64)
    plan = StepPlan(step_id=1, lora_loads=[stale], seqs=[
        ScheduledSeq(1, prompt, 0, [0], sample=SampleSpec(), lora_slot=0),
        ScheduledSeq(2, prompt, 0, [1], sample=SampleSpec())])
    result = runner.execute(plan)
    assert [failure.seq_id for failure in result.failures] == [1]
    assert "changed since it was registered" in result.failures[0].message
    assert [sample.seq_id for sample in result.samples] == [2]
    assert result.samples[0].token_id == greedy(references[0], prompt, 1)[0]
    result = runner.execute(StepPlan(step_id=2, lora_loads=_loads(adapters[:1]), seqs=[
        ScheduledSeq(3, prompt, 0, [2], sample=SampleSpec(), lora_slot=0)]))
    assert not result.failures and result.samples[0].token_id == greedy(references[1], prompt, 1)[0]
    beyond = LoraLoad(7, "a1", str(adapters[1]), folder_digest(adapters[1]))  # the scheduler has more slots
    result = runner.execute(StepPlan(step_id=3, lora_loads=[beyond], seqs=[
        ScheduledSeq(4, prompt, 0, [3], sample=SampleSpec(), lora_slot=7)]))
    assert "--max-loras differs" in result.failures[0].message and not result.samples
    small = _runner(checkpoint_dir(NAME), lora=LoraConfig(max_loras=1, max_lora_rank=4))
    small.execute(StepPlan(step_id=1, lora_loads=_loads(adapters[:1])))
    assert "above --max-lora-rank 4" in small.lora.failed[0]


def _rank_main(rank, folder, init_file, prompts, loads, out_file, world_size):
    from plan_driver import tensor_parallel_rank

    if world_size == 1:
        import torch.distributed as dist  # noqa: F401  one rank needs no process group
        torch.set_num_threads(1)
        runner = _runner(folder, lora=LoraConfig(max_loras=2, max_lora_rank=8))
        driver = PlanDriver(runner, 96)
        generated = _run(driver, prompts, loads)
    else:
        with tensor_parallel_rank(folder, rank, world_size, init_file, num_blocks=96,
                                  lora=LoraConfig(max_loras=2, max_lora_rank=8)) as (runner, driver):
            generated = _run(driver, prompts, loads)
    with open(f"{out_file}.{rank}", "w") as handle:
        json.dump(generated, handle)


def _run(driver, prompts, loads):
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, lora_slot=(i % 3) - 1)
            for i, prompt in enumerate(prompts)]
    driver.run_to_completion(seqs, token_budget=40, lora_loads=loads)
    return [seq.generated for seq in seqs]


def test_two_ranks_equal_one_rank(tmp_path_factory, tmp_path):
    """Column layers slice B, row layers slice A (and all-reduce the rank-r product); one KV head
    replicated, so both shardings of the attention are exercised."""
    base = build_tiny_checkpoint(tmp_path_factory.mktemp("llama-mqa-lora"), architecture="llama", vocab_size=509,
                                 hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, intermediate_size=128,
                                 max_position_embeddings=256, seed=22)
    adapters = [build_peft_adapter(base, tmp_path / f"adapter{i}", seed=200 + i) for i in range(2)]
    loads = _loads(adapters, slots=(0, 1))
    prompts = [[token % 509 for token in prompt] for prompt in make_prompts(seed=34, lengths=(3, 17, 40, 9, 25, 60))]
    _rank_main(0, str(base), None, prompts, loads, str(tmp_path / "one"), 1)
    mp.spawn(_rank_main, args=(str(base), str(tmp_path / "rendezvous"), prompts, loads, str(tmp_path / "two"), 2),
             nprocs=2, join=True)
    one = json.loads((tmp_path / "one.0").read_text())
    two = [json.loads((tmp_path / f"two.{rank}").read_text()) for rank in range(2)]
    assert two[0] == one and two[1] == one
    reference = merged_model(base, adapters[1])
    assert one[2] == greedy(reference, prompts[2], MAX_NEW_TOKENS)
