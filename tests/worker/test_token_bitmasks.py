"""The worker's side of structured output: token bitmask rows and logit_bias applied to the
logits before sampling, so draws, greedy picks and reported logprobs are those of the
constrained distribution; through the codec and a real ModelRunner step as well."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_models import VOCAB_SIZE

from pagedserve.contracts.plan_codec import plan_from_proto, plan_to_proto
from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.sampler import Sampler
from pagedserve.worker.structured_output import apply_constraints, unpack_banned

VOCAB = 70


def _row(allowed: list[int], vocab_size: int = VOCAB) -> bytes:
    words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    for token in allowed:
        words[token // 32] |= np.int32(1 << (token % 32)) if token % 32 != 31 else np.int32(-2**31)
    return words.tobytes()


def test_unpacking_reads_bit_i_as_token_i():
    allowed = [0, 31, 32, 63, 64, 69]
    banned = unpack_banned(_row(allowed), 1, VOCAB)
    assert banned.shape == (1, VOCAB) and torch.nonzero(~banned[0]).flatten().tolist() == allowed
    assert unpack_banned(_row([1]), 1, VOCAB + 40)[0, VOCAB:].all()  # past the rows: banned


def test_masks_and_biases_change_only_their_rows_and_logprobs_are_constrained():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    plain, masked, biased = SampleSpec(), SampleSpec(temperature=1.0, num_logprobs=2), SampleSpec(logit_bias={5: 100.0, 6: -100.0})
    out = apply_constraints(logits, [1], _row([3, 65]), [plain, masked, biased])
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1]).sum() == VOCAB - 2 and out[1, 3] == logits[1, 3]
    assert out[2, 5] == logits[2, 5] + 100 and out[2, 6] == logits[2, 6] - 100
    sampler = Sampler(seed=1)
    for _ in range(20):
        samples = sampler.sample(out, [plain, masked, biased], [0, 1, 2], [4, 4, 4])
        assert samples[1].token_id in (3, 65) and samples[2].token_id == 5
        assert samples[0].token_id == int(logits[0].argmax())
    constrained = logits[1, [3, 65]].log_softmax(dim=-1)
    assert math.isclose(math.exp(samples[1].top_logprobs[0]) + math.exp(samples[1].top_logprobs[1]), 1.0, rel_tol=1e-5)
    assert sorted(samples[1].top_token_ids) == [3, 65]
    assert math.isclose(samples[1].logprob, float(constrained[[3, 65].index(samples[1].token_id)]), rel_tol=1e-5)


def test_no_constraint_leaves_the_logits_tensor_alone():
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    assert apply_constraints(logits, [], b"", [SampleSpec(), SampleSpec()]) is logits


def test_masks_travel_through_the_plan_codec():
    rows = _row([1, 2]) + _row([3]) + _row([4])
    plan = StepPlan(step_id=3, seqs=[
        ScheduledSeq(1, [5], 4, [0], SampleSpec()),
        ScheduledSeq(2, [5, 6, 7], 4, [1], SampleSpec(logit_bias={9: -3.5}), num_draft_tokens=2,
                     num_mask_rows=3, token_bitmask=rows)])
    decoded = plan_from_proto(plan_to_proto(plan))
    assert decoded.seqs[0].num_mask_rows == 0 and decoded.seqs[0].token_bitmask == b""
    assert (decoded.seqs[1].num_mask_rows, decoded.seqs[1].token_bitmask) == (3, rows)
    assert decoded.seqs[1].sample.logit_bias == {9: -3.5}


@pytest.fixture(scope="module")
def runner(checkpoint_dir) -> ModelRunner:
    runner = ModelRunner(checkpoint_dir("llama-gqa-untied"), device="cpu", dtype="float32", block_size=16)
    runner.load()
    runner.init_cache(16, 0)
    return runner


def test_a_runner_step_samples_inside_the_mask_and_verifies_drafts_row_by_row(runner):
    prompt = [11, 12, 13, 14, 15]
    free = ScheduledSeq(1, prompt, 0, [0], SampleSpec())
    baseline = runner.execute(StepPlan(step_id=1, seqs=[free])).samples[0].token_id
    width = VOCAB_SIZE
    forced = ScheduledSeq(2, prompt, 0, [1], SampleSpec(num_logprobs=1), num_mask_rows=1,
                          token_bitmask=_row([baseline + 1], width))
    banned = ScheduledSeq(3, prompt, 0, [2], SampleSpec(logit_bias={baseline: -100.0}))
    result = runner.execute(StepPlan(step_id=2, seqs=[forced, banned]))
    by_seq = {sample.seq_id: sample for sample in result.samples}
    assert by_seq[2].token_id == baseline + 1 and abs(by_seq[2].logprob) < 1e-6
    assert by_seq[3].token_id != baseline
    # three drafts, the mask of the second verified row refuses the second draft: cut there
    drafting = ScheduledSeq(4, prompt + [baseline, 7, 8], 0, [3], SampleSpec(), num_draft_tokens=2,
                            num_mask_rows=3, token_bitmask=_row([7], width) + _row([9], width) + _row([1], width))
    emitted = [sample.token_id for sample in runner.execute(StepPlan(step_id=3, seqs=[drafting])).samples]
    assert emitted == [7, 9]


def test_masks_that_follow_the_plan_are_received_after_the_forward(runner):
    prompt = [21, 22, 23]
    plan = StepPlan(step_id=4, masks_follow=True, seqs=[
        ScheduledSeq(5, prompt, 0, [4], SampleSpec(), num_mask_rows=1),
        ScheduledSeq(6, prompt, 0, [5], SampleSpec())])
    received = []

    def receive() -> bytes:
        received.append(True)
        return _row([99], VOCAB_SIZE)

    samples = runner.execute(plan_from_proto(plan_to_proto(plan)), receive).samples
    assert received and samples[0].token_id == 99
    with pytest.raises(Exception, match="follow"):
        runner.execute(StepPlan(step_id=5, masks_follow=True, seqs=[
            ScheduledSeq(7, prompt, 0, [6], SampleSpec(), num_mask_rows=1)]))
