"""Whole decoder layers in one native call for decode steps of one or two rows
(worker/models/llama_native.py) against the per-op path of the same model, in bfloat16 and
float32, and bfloat16 against float32: the same cache, the same decode step, logits compared."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_prompts
from gguf_fixtures import GGUF_FILE, gguf_model, write_all_kept  # noqa: F401 (fixture)

from pagedserve.kernels import ops
from pagedserve.kernels.linear import native_rows
from pagedserve.kernels.linear.block_quant import BlockQuantWeight
from pagedserve.kernels.native import library as native_lib
from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq
from pagedserve.worker.model_input import build_model_input
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.models import llama_native

HAS_ROW_KERNELS = native_lib.load() is not None and native_rows.supports(
    torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16)) is not None
needs_row_kernels = pytest.mark.skipif(not HAS_ROW_KERNELS, reason="needs a C compiler and AVX-512 BF16")


FOR_STEP = llama_native.NativeDecodeStep.for_step.__func__


def _runner(path, dtype: str, kv_cache_dtype: str = "auto", quantization: str = "auto",
            num_blocks: int = 64) -> ModelRunner:
    runner = ModelRunner(path, device="cpu", dtype=dtype, block_size=16, kv_cache_dtype=kv_cache_dtype,
                         quantization=quantization)
    runner.load()
    runner.init_cache(num_blocks, 0)
    return runner


def _decode_logits(runner: ModelRunner, prompts: list[list[int]], native: bool, monkeypatch,
                   expect_native: bool | None = None) -> torch.Tensor:
    """Prefills the prompts but their last token (per-op path), then one decode step of the last tokens,
    native layers allowed or not; checks which path the decode step took (expect_native, default native)."""
    model = runner.model
    tables = [[8 * i + j for j in range(-(-len(prompt) // 16))] for i, prompt in enumerate(prompts)]
    taken = []
    def for_step(cls, *args):
        step = FOR_STEP(cls, *args) if native else None
        taken.append(step is not None)
        return step

    monkeypatch.setattr(llama_native.NativeDecodeStep, "for_step", classmethod(for_step))

    def forward(seqs):
        inputs = build_model_input(seqs, block_size=16, num_blocks=runner.cache.num_gpu_blocks,
                                   max_positions=model.max_positions, device=runner.device)
        with torch.inference_mode():
            return model.compute_logits(model(inputs.token_ids, inputs.metadata, runner.cache.gpu_cache))

    forward([ScheduledSeq(seq_id=i, token_ids=prompt[:-1], start_position=0, block_table=table, sample=SampleSpec())
             for i, (prompt, table) in enumerate(zip(prompts, tables))])
    taken.clear()
    logits = forward([ScheduledSeq(seq_id=i, token_ids=prompt[-1:], start_position=len(prompt) - 1,
                                   block_table=table, sample=SampleSpec())
                      for i, (prompt, table) in enumerate(zip(prompts, tables))])
    assert taken == [native if expect_native is None else expect_native]
    return logits.float()


@needs_row_kernels
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied", "mistral-window-48", "llama3-rope-scaling"])
@pytest.mark.parametrize("lengths", [(70,), (33, 90), (5, 17, 40, 81)])
def test_native_layers_give_the_per_op_logits(checkpoint_dir, monkeypatch, name, lengths):
    prompts = make_prompts(seed=len(lengths), lengths=lengths)
    bf16 = _runner(checkpoint_dir(name), "bfloat16")
    native = _decode_logits(bf16, prompts, True, monkeypatch)
    per_op = _decode_logits(bf16, prompts, False, monkeypatch)
    float32 = _runner(checkpoint_dir(name), "float32")
    exact = _decode_logits(float32, prompts, False, monkeypatch)
    scale = exact.abs().max()
    # float32: the same logits but for the order of float32 sums
    assert torch.allclose(_decode_logits(float32, prompts, True, monkeypatch), exact, rtol=1e-4, atol=1e-4 * scale)
    assert (native - per_op).abs().max() <= 0.03 * scale
    assert torch.equal(native.argmax(-1), per_op.argmax(-1))
    # as close to float32 as the per-op bfloat16 path (bfloat16 rounding, not a wrong result)
    assert (native - exact).abs().max() <= 2 * (per_op - exact).abs().max() + 0.01 * scale


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied"])
def test_float32_layers_take_the_float32_row_kernel_wherever_it_is_built(checkpoint_dir, monkeypatch, name):
    """Dense float32 layers chain linear_rows_f32 (AVX-512, or its AVX2 twin on a CPU without the
    bfloat16 row kernels, where bfloat16 layers keep the per-op path): the per-op logits but for the
    order of float32 sums."""
    lib = ops.decode_layer_library()
    if lib is None or not ops.chains_dense(lib, torch.float32):
        pytest.skip("needs a C compiler and AVX2 with FMA")
    prompts = make_prompts(seed=2, lengths=(33, 90))
    runner = _runner(checkpoint_dir(name), "float32")
    native = _decode_logits(runner, prompts, True, monkeypatch)
    per_op = _decode_logits(runner, prompts, False, monkeypatch)
    scale = per_op.abs().max()
    assert torch.allclose(native, per_op, rtol=1e-4, atol=1e-4 * scale)
    assert torch.equal(native.argmax(-1), per_op.argmax(-1))
    if not HAS_ROW_KERNELS:
        _decode_logits(_runner(checkpoint_dir(name), "bfloat16"), prompts, True, monkeypatch, expect_native=False)


def _chunk_logits(runner: ModelRunner, prompts: list[list[int]], cached: list[int], native: bool,
                  monkeypatch) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """Each prompt's first `cached` tokens through the per-op path; then one step of the rest of
    every prompt but its last token (prefill chunks, one token each where a prompt leaves one),
    native layers allowed or not; then one decode step of the last tokens through the per-op path,
    which reads the K/V the chunks wrote. The logits of the two steps, and which took the native
    layers."""
    tables = [[8 * i + j for j in range(-(-len(prompt) // 16))] for i, prompt in enumerate(prompts)]
    taken, index = [], []

    def for_step(cls, *args):
        step = FOR_STEP(cls, *args) if native and len(index) == 2 else None
        taken.append(step is not None)
        return step

    monkeypatch.setattr(llama_native.NativeDecodeStep, "for_step", classmethod(for_step))
    model = runner.model
    steps = [[(prompt[:count], 0) for prompt, count in zip(prompts, cached)],
             [(prompt[count:-1], count) for prompt, count in zip(prompts, cached)],
             [(prompt[-1:], len(prompt) - 1) for prompt in prompts]]
    logits = []
    for step in steps:
        index.append(len(index))
        seqs = [ScheduledSeq(seq_id=i, token_ids=tokens, start_position=start, block_table=table, sample=SampleSpec())
                for i, ((tokens, start), table) in enumerate(zip(step, tables)) if tokens]
        if not seqs:
            continue  # nothing cached
        inputs = build_model_input(seqs, block_size=16, num_blocks=runner.cache.num_gpu_blocks,
                                   max_positions=model.max_positions, device=runner.device)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(inputs.token_ids, inputs.metadata, runner.cache.gpu_cache)))
    return logits[-2].float(), logits[-1].float(), taken


@needs_row_kernels
@pytest.mark.parametrize("name", ["llama-gqa-untied", "mistral-window-48"])
@pytest.mark.parametrize("lengths,cached", [((22,), (0,)), ((12, 40, 9), (3, 30, 7)), ((60,), (49,))])
def test_prefill_chunks_take_a_row_per_token(checkpoint_dir, monkeypatch, name, lengths, cached):
    """In bfloat16 a step of prefill chunks (after cached prefixes, beside one-token chunks) of up
    to MAX_PACKED_ROWS tokens takes the native layers, a row per token attending as a decode at its
    position: its logits and the K/V it wrote (read by the next decode) as close to the per-op
    path's as decodes are (test_native_layers_give_the_per_op_logits), the same greedy tokens; the
    same step in float32 keeps the per-op path."""
    prompts = make_prompts(seed=sum(lengths), lengths=lengths)
    bf16 = _runner(checkpoint_dir(name), "bfloat16")
    chunk, decode, taken = _chunk_logits(bf16, prompts, list(cached), True, monkeypatch)
    assert taken == [False, True, False][-len(taken):]
    chunk_per_op, decode_per_op, _ = _chunk_logits(bf16, prompts, list(cached), False, monkeypatch)
    float32 = _runner(checkpoint_dir(name), "float32")
    chunk_exact, decode_exact, taken = _chunk_logits(float32, prompts, list(cached), True, monkeypatch)
    assert not any(taken)
    for native, per_op, exact in ((chunk, chunk_per_op, chunk_exact), (decode, decode_per_op, decode_exact)):
        scale = exact.abs().max()
        assert (native - per_op).abs().max() <= 0.03 * scale
        assert torch.equal(native.argmax(-1), per_op.argmax(-1))
        assert (native - exact).abs().max() <= 2 * (per_op - exact).abs().max() + 0.01 * scale


@needs_row_kernels
def test_a_float32_cache_under_a_bfloat16_model(checkpoint_dir, monkeypatch):
    prompts = make_prompts(seed=3, lengths=(40,))
    runner = _runner(checkpoint_dir("llama-gqa-untied"), "bfloat16", kv_cache_dtype="float32")
    native = _decode_logits(runner, prompts, True, monkeypatch)
    per_op = _decode_logits(runner, prompts, False, monkeypatch)
    assert (native - per_op).abs().max() <= 0.03 * per_op.abs().max()


def _tuned(monkeypatch, layout: str, few_rows: str) -> None:
    """This host's kernel tuning as if it had chosen `layout` and `few_rows` (kernels/native/tuning.py)."""
    lib = native_lib.load()
    if lib is not None:
        monkeypatch.setattr(lib, "_pagedserve_tuning", {**getattr(lib, "_pagedserve_tuning", {}),
                                                        "linear_bf16_layout": layout, "linear_bf16_few_rows": few_rows})


@needs_row_kernels
def test_steps_it_does_not_take(checkpoint_dir, monkeypatch):
    _tuned(monkeypatch, "onednn", "rows")  # dense weights
    prompts = make_prompts(seed=4, lengths=(20, 21, 22, 23, 24))
    runner = _runner(checkpoint_dir("llama-gqa-untied"), "bfloat16")
    _decode_logits(runner, prompts, True, monkeypatch, expect_native=False)  # five rows: above MAX_ROWS
    fp8 = _runner(checkpoint_dir("llama-gqa-untied"), "bfloat16", kv_cache_dtype="fp8_e4m3")
    _decode_logits(fp8, prompts[:1], True, monkeypatch, expect_native=False)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "reference")
    _decode_logits(_runner(checkpoint_dir("llama-gqa-untied"), "bfloat16"), prompts[:1], True, monkeypatch,
                   expect_native=False)


@pytest.fixture(scope="module")
def all_kept(tmp_path_factory):
    return write_all_kept(tmp_path_factory, seed=35)


@pytest.mark.parametrize("model", ["all-kept", "llama-mixed"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_native_layers_multiply_kept_gguf_blocks_as_the_per_op_path(all_kept, gguf_model, monkeypatch, model,
                                                                    dtype):
    """--quantization auto keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks; the native layers multiply them
    with the same block kernels as the per-op path (dense projections beside them, llama-mixed, keep
    the row kernel), so the logits agree but for the order of float32 sums in RMSNorm and attention."""
    if ops.decode_layer_library() is None:
        pytest.skip("needs a C compiler and AVX-512, or AVX2 with FMA and F16C")
    # without the bfloat16 row kernels (AVX2): float32 layers alone (dense ones through the float32 row
    # kernel where it is built), bfloat16 layers keep the per-op path
    takes_native = HAS_ROW_KERNELS or (dtype == "float32" and (
        model == "all-kept" or ops.chains_dense(ops.decode_layer_library(), torch.float32)))
    path = all_kept if model == "all-kept" else gguf_model("llama-mixed") / GGUF_FILE
    runner = _runner(path, dtype, num_blocks=96)
    kinds = {type(module.packed).__name__ for name, module in runner.model.named_modules()
             if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
    assert BlockQuantWeight.__name__ in kinds and (model == "all-kept") == (kinds == {BlockQuantWeight.__name__})
    # nine rows: the all-kept model's layers are all blocks (llama_native.MAX_PACKED_ROWS)
    nine = [(3, 9, 17, 12, 5, 30, 8, 21, 14)] if model == "all-kept" else []
    for lengths in [(70,), (5, 17, 40, 81), *nine]:
        prompts = make_prompts(seed=len(lengths), lengths=lengths)
        native = _decode_logits(runner, prompts, True, monkeypatch, expect_native=takes_native)
        per_op = _decode_logits(runner, prompts, False, monkeypatch)
        scale = per_op.abs().max()
        tolerance = 1e-4 if dtype == "float32" else 0.03
        assert (native - per_op).abs().max() <= tolerance * scale
        assert torch.equal(native.argmax(-1), per_op.argmax(-1))


@needs_row_kernels
@pytest.mark.parametrize("few_rows", ["panels", "rows"])
def test_layers_in_panels_take_up_to_32_rows(checkpoint_dir, monkeypatch, few_rows):
    """With every projection in panels, the native layers take decode steps of up to MAX_PACKED_ROWS
    rows (the per-op path calls the same panel kernel there), whether one or two rows take the
    panels or the row kernel; without panels they stop at MAX_ROWS."""
    lib = native_lib.load()
    if lib is None or not lib.panel_linear_available():
        pytest.skip("needs the native panel kernel (AVX-512 BF16)")
    _tuned(monkeypatch, "panels", few_rows)
    prompts = make_prompts(seed=6, lengths=tuple(range(3, 3 + llama_native.MAX_PACKED_ROWS + 1)))
    runner = _runner(checkpoint_dir("qwen2-bias-tied"), "bfloat16", num_blocks=8 * len(prompts))
    exact = _decode_logits(_runner(checkpoint_dir("qwen2-bias-tied"), "float32", num_blocks=8 * 9), prompts[:9], False,
                           monkeypatch)
    native = _decode_logits(runner, prompts[:9], True, monkeypatch)  # nine rows: above MAX_ROWS
    per_op = _decode_logits(runner, prompts[:9], False, monkeypatch)
    scale = exact.abs().max()
    assert (native - per_op).abs().max() <= 0.03 * scale
    assert torch.equal(native.argmax(-1), per_op.argmax(-1))
    assert (native - exact).abs().max() <= 2 * (per_op - exact).abs().max() + 0.01 * scale
    _decode_logits(runner, prompts, True, monkeypatch, expect_native=False)  # 33 rows
    _tuned(monkeypatch, "onednn", "rows")
    _decode_logits(_runner(checkpoint_dir("qwen2-bias-tied"), "bfloat16", num_blocks=8 * 9), prompts[:9], True,
                   monkeypatch, expect_native=False)


@needs_row_kernels
@pytest.mark.parametrize("few_rows", ["panels", "rows"])
def test_native_layers_multiply_the_panels_where_ops_linear_does(checkpoint_dir, monkeypatch, few_rows):
    """A host whose tuning keeps bfloat16 panels (kernels/native/tuning.py): with panels for few rows
    too, the native layers multiply the panels as ops.linear does; otherwise the dense weight."""
    from pagedserve.kernels import ops

    lib = native_lib.load()
    if lib is None or not lib.panel_linear_available():
        pytest.skip("needs the native panel kernel (AVX-512 BF16)")
    monkeypatch.setattr(lib, "_pagedserve_tuning", {**lib._pagedserve_tuning, "linear_bf16_layout": "panels",
                                                    "linear_bf16_few_rows": few_rows})
    bf16 = _runner(checkpoint_dir("qwen2-bias-tied"), "bfloat16")
    float32 = _runner(checkpoint_dir("qwen2-bias-tied"), "float32")
    for lengths in [(9, 33), (5, 17, 40, 81)]:  # the row kernel's two rows, then the panels' four
        prompts = make_prompts(seed=len(lengths), lengths=lengths)
        native = _decode_logits(bf16, prompts, True, monkeypatch)
        per_op = _decode_logits(bf16, prompts, False, monkeypatch)
        exact = _decode_logits(float32, prompts, False, monkeypatch)
        scale = exact.abs().max()
        assert (native - per_op).abs().max() <= 0.03 * scale
        assert torch.equal(native.argmax(-1), per_op.argmax(-1))
        assert (native - exact).abs().max() <= 2 * (per_op - exact).abs().max() + 0.01 * scale
    layer = bf16.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.prepacked_weight, ops.PanelWeight)
    weights = layer._native_decode[1]
    assert weights.qkv_panels and weights.down_panels  # above two rows, or always without the dense weight
    assert bool(weights.w_qkv) == bool(weights.w_down) == (few_rows == "rows")


@needs_row_kernels
def test_a_new_cache_after_init_cache_gets_new_layer_structures(checkpoint_dir, monkeypatch):
    """The model keeps its layers' structures for the list of caches they point into; init_cache
    allocates a new list, and the next native step points into the new caches, with the logits of a
    runner that never had the old ones."""
    prompts = make_prompts(seed=5, lengths=(21, 40))
    runner = _runner(checkpoint_dir("llama-gqa-untied"), "bfloat16")
    first = _decode_logits(runner, prompts, True, monkeypatch)
    old_caches = runner.cache.gpu_cache
    assert runner.model._native_layers[0] is old_caches
    runner.init_cache(64, 0)
    assert runner.cache.gpu_cache is not old_caches
    again = _decode_logits(runner, prompts, True, monkeypatch)
    layers = runner.model._native_layers
    assert layers[0] is runner.cache.gpu_cache
    assert [weights.key_cache for weights in layers[2]] == [key.data_ptr() for key, _ in runner.cache.gpu_cache]
    assert torch.equal(again, first)


@needs_row_kernels
def test_a_whole_native_step_gives_the_bits_of_the_layers_between_torch_embedding_and_norm(checkpoint_dir):
    """bfloat16, every row sampling: the embedding, the layers and the final norm in one native call
    (decode_step) give what the layers' call between the model's own embedding and final norm gives,
    bit for bit; a token outside the table raises IndexError as the embedding lookup does."""
    runner = _runner(checkpoint_dir("qwen2-bias-tied"), "bfloat16")
    model = runner.model
    prompts = make_prompts(seed=9, lengths=(12, 30, 47))
    tables = [[8 * i + j for j in range(-(-len(prompt) // 16))] for i, prompt in enumerate(prompts)]

    def step_input(last_only: bool):
        seqs = [ScheduledSeq(seq_id=i, token_ids=prompt[-1:] if last_only else prompt[:-1],
                             start_position=len(prompt) - 1 if last_only else 0, block_table=table,
                             sample=SampleSpec()) for i, (prompt, table) in enumerate(zip(prompts, tables))]
        return build_model_input(seqs, block_size=16, num_blocks=runner.cache.num_gpu_blocks,
                                 max_positions=model.max_positions, device=runner.device)

    with torch.inference_mode():
        prefill = step_input(False)
        model(prefill.token_ids, prefill.metadata, runner.cache.gpu_cache)
        inputs = step_input(True)
        step = llama_native.NativeDecodeStep.for_step(model, inputs.metadata, runner.cache.gpu_cache)
        whole = step.final_hidden(inputs.token_ids)
        hidden, residual = step.run(model.embed_tokens(inputs.token_ids))  # rewrites the same K/V
        expected, _ = model.norm(hidden, residual)
        assert whole.dtype == torch.bfloat16 and torch.equal(whole, expected)
        assert torch.equal(model(inputs.token_ids, inputs.metadata, runner.cache.gpu_cache), expected)
        with pytest.raises(IndexError, match="outside the embedding table"):
            step.final_hidden(torch.tensor([1, model.embed_tokens.weight.shape[0], 2]))
        # bound once to kept tensors, called again with new values: each call the bits of run_step's,
        # nothing carried over from the call before in the buffers it keeps
        token_ids, out = inputs.token_ids.clone(), torch.empty_like(whole)
        bound = step.layers.bound_step(token_ids, model.embed_tokens.weight, model.norm.weight, model.norm.eps, out)
        for ids in ([5, 9, 2], [7, 7, 7], inputs.token_ids.tolist()):
            token_ids.copy_(torch.tensor(ids))
            bound()
            assert torch.equal(out, step.layers.run_step(token_ids, model.embed_tokens.weight, model.norm.weight,
                                                         model.norm.eps))
        assert torch.equal(out, expected)
        token_ids[1] = model.embed_tokens.weight.shape[0]
        with pytest.raises(IndexError, match="outside the embedding table"):
            bound()
        float32 = _runner(checkpoint_dir("qwen2-bias-tied"), "float32")
        step32 = llama_native.NativeDecodeStep.for_step(float32.model, inputs.metadata, float32.cache.gpu_cache)
        assert step32 is not None and step32.final_hidden(inputs.token_ids) is None  # float32 keeps torch's norm


@needs_row_kernels
@pytest.mark.parametrize("name", ["qwen2-bias-tied", "mistral-window-48"])
@pytest.mark.parametrize("lengths", [(70,), (5, 17, 40, 81), (300,), (5, 17, 40, 400)])
def test_layers_in_one_parallel_region_give_the_chains_bits(checkpoint_dir, monkeypatch, name, lengths):
    """With every projection in panels and a few rows (decode_layer.c, "Layers in one parallel
    region"), two or three threads run the layers in one region, thread 0 the one-thread ops while
    the others read ahead in the next projection: the logits equal, bit for bit, those of one thread, which
    runs the per-layer chain. Contexts long enough for attention to share its tasks between the
    threads (300 positions x 2 KV heads and more; not under mistral's window of 48) share them
    inside the region, over runs of several chunks merged."""
    lib = native_lib.load()
    if lib is None or not lib.panel_linear_available():
        pytest.skip("needs the native panel kernel (AVX-512 BF16)")
    _tuned(monkeypatch, "panels", "panels")
    runner = _runner(checkpoint_dir(name), "bfloat16", num_blocks=96)
    prompts = make_prompts(seed=len(lengths), lengths=lengths)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        before = lib.decode_layers_overlapped()
        two = _decode_logits(runner, prompts, True, monkeypatch)
        took = lib.decode_layers_overlapped() - before
        torch.set_num_threads(3)  # two threads reading ahead, each counting its shares done
        before = lib.decode_layers_overlapped()
        three = _decode_logits(runner, prompts, True, monkeypatch)
        took_three = lib.decode_layers_overlapped() - before
        torch.set_num_threads(1)
        before = lib.decode_layers_overlapped()
        one = _decode_logits(runner, prompts, True, monkeypatch)
        assert lib.decode_layers_overlapped() == before
    finally:
        torch.set_num_threads(threads)
    assert took == took_three == 1
    assert torch.equal(two, one) and torch.equal(three, one)
