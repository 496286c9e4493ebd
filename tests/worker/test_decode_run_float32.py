"""The decode run in float32 (worker/decode_run.py, kernels/native/decode_run.c), on any CPU with the
native float32 block kernel (AVX-512, or AVX2 with FMA and F16C): a GGUF file's blocks kept, its
Q8_0 LM head writing float32 logits, greedy over them. The default model on a CPU without AVX-512
BF16 (`--dtype auto` is float32 there) takes this path. Against the full step and against the
plan-per-step loop, bit for bit, as test_decode_run.py checks the bfloat16 runs; a dense float32
model keeps the full step (torch's final norm)."""

from __future__ import annotations

import pytest
import torch
from gguf_fixtures import write_all_kept
from test_decode_run import _decode, _prefill, _runner, straight_through
from tiny_models import make_prompts

from pagedserve.contracts.step_plan import SampleSpec
from pagedserve.kernels import ops
from pagedserve.kernels.native import library as native_lib

pytestmark = pytest.mark.skipif(
    native_lib.load() is None or not native_lib.has_kernel(native_lib.load(), "block_quant_rows")
    or ops.decode_layer_library() is None,
    reason="needs a C compiler and the float32 block kernel (AVX-512, or AVX2 with FMA and F16C)")


@pytest.mark.parametrize("num_seqs", [1, 2])
def test_kept_gguf_blocks_in_float32_give_the_full_steps_samples(tmp_path_factory, num_seqs):
    path = write_all_kept(tmp_path_factory, seed=41)
    full, kept = _runner(path, "float32"), _runner(path, "float32")
    prompts = make_prompts(seed=num_seqs, lengths=(11, 26)[:num_seqs])
    plan = _prefill((full, kept), prompts, [[1, 2, 3], [5, 6, 7]][:num_seqs], SampleSpec())
    samples, _ = _decode(full, kept, plan, 8)
    assert len(samples) == 8
    run = kept._decode_run
    assert run is not None and run.native.logits is not None and run.native.logits.dtype == torch.float32


@pytest.mark.parametrize("lengths", [(11,), (11, 26)])
@pytest.mark.parametrize("streams", [False, True])
def test_a_float32_runs_steps_in_one_call_are_the_plans_steps(tmp_path_factory, streams, lengths):
    straight_through(write_all_kept(tmp_path_factory, seed=41), "float32", streams, lengths)


def test_a_dense_float32_model_takes_the_full_step(checkpoint_dir):
    full, kept = _runner(checkpoint_dir("llama-gqa-untied"), "float32"), _runner(checkpoint_dir("llama-gqa-untied"),
                                                                                 "float32")
    plan = _prefill((full, kept), make_prompts(seed=7, lengths=(10,)), [[1, 2]], SampleSpec())
    _decode(full, kept, plan, 3)
    assert kept._decode_run is None
