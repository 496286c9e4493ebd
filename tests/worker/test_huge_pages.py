"""The weights on 2 MiB pages (pagedserve/huge_pages.py): every tensor the loaded model
holds (dense and prepacked bfloat16, GGUF blocks, int8/int4 codes, a tied LM head) is moved into
memory marked MADV_HUGEPAGE with its values unchanged and its references kept, and the model then
decodes exactly as it does on ordinary pages.

These run where the host lets a program ask for transparent huge pages (`madvise` or `always` in
/sys/kernel/mm/transparent_hugepage/enabled); elsewhere the move is off and they are skipped."""

from __future__ import annotations

import io

import pytest
import torch
from gguf_fixtures import GGUF_FILE, write_all_kept
from plan_driver import DrivenSeq, PlanDriver
from tiny_models import make_prompts

from pagedserve.kernels.linear.block_quant import BlockQuantWeight
from pagedserve.kernels.linear.panels import PanelWeight
from pagedserve import huge_pages
from pagedserve.worker.model_runner import ModelRunner

NAME = "qwen2-bias-tied"
NUM_BLOCKS = 64

pytestmark = pytest.mark.skipif(not huge_pages.available(),
                                reason="this host gives no transparent huge pages to programs")


def _huge_kib(tensor: torch.Tensor) -> int:
    """KiB of the tensor's mapping the kernel backs with huge pages (anonymous, private memory)."""
    return int(huge_pages.mapping_fields(tensor.data_ptr())["AnonHugePages"].split()[0])


def _snapshot(model) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {id(tensor): (tensor, tensor.clone()) for tensor in huge_pages.model_tensors(model)}


def _greedy(runner: ModelRunner) -> list[list[int]]:
    driver = PlanDriver(runner, NUM_BLOCKS)
    seqs = [DrivenSeq(seq_id=i, prompt=prompt, max_new_tokens=8)
            for i, prompt in enumerate(make_prompts(seed=4, lengths=(1, 17, 40)))]
    driver.run_to_completion(seqs, token_budget=64)
    return [seq.generated for seq in seqs]


def _counted_mappings(monkeypatch) -> list[int]:
    """The sizes of the mappings pagedserve/huge_pages.py makes from now on (its `_mapping`, spied on):
    whether a plain tensor's memory lies in a mapping marked MADV_HUGEPAGE also depends on what
    this process's allocators did before, over a whole test session, so the tests count these."""
    requested: list[int] = []
    make_mapping = huge_pages._mapping
    monkeypatch.setattr(huge_pages, "_mapping",
                        lambda num_bytes: requested.append(num_bytes) or make_mapping(num_bytes))
    return requested


def _runner(path, monkeypatch, *, huge: bool, **options) -> ModelRunner:
    monkeypatch.setenv(huge_pages.ENV, "1" if huge else "0")
    runner = ModelRunner(path, device="cpu", block_size=16, **options)
    runner.load()
    runner.init_cache(NUM_BLOCKS, 0)
    return runner


def test_a_module_moves_with_its_values_and_references_kept():
    embedding = torch.nn.Embedding(4096, 576).to(torch.bfloat16)
    model = torch.nn.Module()
    model.embedding = embedding
    model.linear = torch.nn.Linear(576, 1000).to(torch.bfloat16)
    model.head_weight = embedding.weight  # tied: one tensor, two names
    model.panels = PanelWeight(torch.randn(63 * 16 * 576).bfloat16(), 1000, 576)
    model.register_buffer("table", torch.randn(100, 64))
    before = _snapshot(model)
    assert len(before) == 5  # the tied weight counted once
    num_bytes = sum(tensor.untyped_storage().nbytes() for tensor, _ in before.values())
    moved = huge_pages.move_to_huge_pages(model)
    assert num_bytes <= moved < num_bytes + 64 * len(before)
    for tensor, values in before.values():
        assert torch.equal(tensor, values) and huge_pages.is_marked(tensor)
    assert model.head_weight is model.embedding.weight and isinstance(model.linear.weight, torch.nn.Parameter)
    x = torch.randn(3, 576).bfloat16()
    assert torch.equal(model.linear(x), torch.nn.functional.linear(x, before[id(model.linear.weight)][1],
                                                                    before[id(model.linear.bias)][1]))
    buffer_start = min(tensor.data_ptr() for tensor, _ in before.values())
    assert buffer_start % huge_pages.HUGE_PAGE == 0
    assert _huge_kib(model.head_weight) >= 2048  # the kernel did give 2 MiB pages (private anonymous memory)
    saved = io.BytesIO()  # each tensor keeps a storage of its own bytes: saving one writes only those
    torch.save({"table": model.table, "bias": model.linear.bias}, saved)
    assert saved.tell() < 100 * 64 * 4 + 1000 * 2 + 4096


def test_off_by_the_environment_moves_nothing(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    model = torch.nn.Linear(1024, 1024)
    address = model.weight.data_ptr()
    assert huge_pages.move_to_huge_pages(model) == 0 and model.weight.data_ptr() == address
    requested = _counted_mappings(monkeypatch)
    assert huge_pages.huge_page_buffer(4 << 20).numel() == 4 << 20 and requested == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_loaded_model_is_all_on_huge_pages_and_decodes_the_same_tokens(checkpoint_dir, monkeypatch, dtype):
    moved = _runner(checkpoint_dir(NAME), monkeypatch, huge=True, dtype=dtype)
    tensors = huge_pages.model_tensors(moved.model)
    assert tensors and all(huge_pages.is_marked(tensor) for tensor in tensors)
    if dtype == "bfloat16" and any(isinstance(getattr(module, "prepacked_weight", None), PanelWeight)
                                   for module in moved.model.modules()):
        panels = [module.prepacked_weight.data for module in moved.model.modules()
                  if isinstance(getattr(module, "prepacked_weight", None), PanelWeight)]
        assert all(huge_pages.is_marked(data) for data in panels)
    requested = _counted_mappings(monkeypatch)  # with the environment off the load asks for none
    plain = _runner(checkpoint_dir(NAME), monkeypatch, huge=False, dtype=dtype)
    assert requested == []
    moved_again = _runner(checkpoint_dir(NAME), monkeypatch, huge=True, dtype=dtype)
    assert requested and all(huge_pages.is_marked(tensor) for tensor in huge_pages.model_tensors(moved_again.model))
    for (name, a), (_, b) in zip(moved.model.state_dict().items(), plain.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert _greedy(moved) == _greedy(plain)


def test_gguf_blocks_kept_quantized_move_too(tmp_path_factory, monkeypatch):
    path = write_all_kept(tmp_path_factory, seed=35)
    assert path.name == GGUF_FILE
    moved = _runner(path, monkeypatch, huge=True, dtype="float32", quantization="auto")
    blocks = [module.packed for module in moved.model.modules() if isinstance(getattr(module, "packed", None),
                                                                              BlockQuantWeight)]
    assert blocks and all(huge_pages.is_marked(tensor) for weight in blocks
                          for tensor in (weight.qs, weight.scales, weight.mins) if tensor is not None)
    plain = _runner(path, monkeypatch, huge=False, dtype="float32", quantization="auto")
    assert _greedy(moved) == _greedy(plain)
