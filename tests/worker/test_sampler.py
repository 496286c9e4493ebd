"""Sampler semantics: greedy, seeded batch independence, support restriction, penalties, logprobs, beams."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pagedserve.contracts.step_plan import SampleSpec
from pagedserve.worker.sampler import Sampler, SamplerError, apply_penalties, derive_seed, restrict_support

VOCAB = 64


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:  # [rows, VOCAB]
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _sample(logits, specs, positions=None, sampler=None):
    sampler = sampler or Sampler(seed=0)
    positions = positions or [10] * len(specs)
    return sampler.sample(logits, specs, list(range(len(specs))), positions)


def test_all_greedy_is_argmax_with_ties_to_lowest_id():
    logits = _logits(8)
    logits[3, 7] = logits[3, 40] = logits[3].max() + 1.0  # a tie: the lower id wins
    samples = _sample(logits, [SampleSpec() for _ in range(8)])
    assert [s.token_id for s in samples] == logits.argmax(dim=-1).tolist()
    assert samples[3].token_id == 7


def test_plain_greedy_batch_matches_the_general_path():
    """A batch of plain greedy specs (one shared object, as decoded plans share them) takes the
    one-argmax path; a logprobs row sends the same batch through the general path."""
    logits = _logits(6, seed=3)
    shared = SampleSpec()
    fast = _sample(logits, [shared] * 6)
    general = _sample(logits, [shared] * 5 + [SampleSpec(num_logprobs=1)])
    expected_logprobs = logits.log_softmax(dim=-1).gather(1, logits.argmax(dim=-1)[:, None])[:, 0]
    assert [s.token_id for s in fast] == [s.token_id for s in general] == logits.argmax(dim=-1).tolist()
    assert [s.logprob for s in fast[:5]] == pytest.approx([s.logprob for s in general[:5]], abs=1e-6)
    assert [s.logprob for s in fast] == pytest.approx(expected_logprobs.tolist(), abs=1e-5)
    assert all(not s.top_token_ids and not s.beam_token_ids for s in fast)


def test_seeded_sampling_is_batch_independent():
    logits = _logits(16, seed=1)
    tokens_alone, tokens_batched = [], []
    for seed in range(24):
        spec = SampleSpec(temperature=1.0, top_p=0.95, seed=seed)
        alone = _sample(logits[5:6], [spec], positions=[33], sampler=Sampler(seed=123))[0].token_id
        others = [SampleSpec(temperature=0.7, seed=1000 + i) if i % 3 else SampleSpec(temperature=1.3)
                  for i in range(16)]
        others[5] = spec
        others[9] = SampleSpec()  # greedy neighbour
        positions = [33 if i == 5 else 7 + i for i in range(16)]
        batched = _sample(logits, others, positions=positions, sampler=Sampler(seed=999))[5].token_id
        tokens_alone.append(alone)
        tokens_batched.append(batched)
    assert tokens_alone == tokens_batched
    assert len(set(tokens_alone)) > 3  # the seed really drives the draw


def test_seeded_draw_depends_on_output_index_and_position():
    logits = torch.zeros(1, VOCAB)  # uniform: any change of generator shows up
    base = [_sample(logits, [SampleSpec(temperature=1.0, seed=s)], positions=[5])[0].token_id for s in range(8)]
    other_index = [_sample(logits, [SampleSpec(temperature=1.0, seed=s, output_index=1)], positions=[5])[0].token_id
                   for s in range(8)]
    other_position = [_sample(logits, [SampleSpec(temperature=1.0, seed=s)], positions=[6])[0].token_id
                      for s in range(8)]
    assert base != other_index and base != other_position
    assert derive_seed(1, 0, 5) == derive_seed(1, 0, 5) != derive_seed(1, 0, 6)


def test_top_k_one_equals_greedy():
    logits = _logits(32, seed=2)
    samples = _sample(logits, [SampleSpec(temperature=1.5, top_k=1) for _ in range(32)])
    assert [s.token_id for s in samples] == logits.argmax(dim=-1).tolist()


def _rows_with_probs(probs: list[float], num_rows: int) -> torch.Tensor:  # [rows, VOCAB]
    row = torch.full((VOCAB,), -1e9)
    row[: len(probs)] = torch.tensor(probs).log()
    return row.repeat(num_rows, 1)


@pytest.mark.parametrize("spec, support", [
    (SampleSpec(temperature=1.0, top_p=0.7), {0, 1}),  # 0.5 + 0.3 reaches 0.7
    (SampleSpec(temperature=1.0, top_p=0.85), {0, 1, 2}),
    (SampleSpec(temperature=1.0, min_p=0.25), {0, 1}),  # threshold 0.125
    (SampleSpec(temperature=1.0, top_k=3), {0, 1, 2}),
])
def test_top_p_min_p_top_k_restrict_support(spec, support):
    probs = [0.5, 0.3, 0.12, 0.08]
    logits = _rows_with_probs(probs, 3000)
    drawn = {s.token_id for s in _sample(logits, [spec] * 3000)}
    assert drawn == support
    masked = restrict_support(logits[:1], [spec])[0]
    assert set(torch.isfinite(masked).nonzero().flatten().tolist()) == support


def test_draw_frequencies_follow_probabilities():
    probs = [0.5, 0.3, 0.2]
    tokens = torch.tensor([s.token_id for s in _sample(_rows_with_probs(probs, 6000),
                                                       [SampleSpec(temperature=1.0)] * 6000)])
    frequencies = torch.bincount(tokens, minlength=3)[:3].float() / 6000
    assert torch.allclose(frequencies, torch.tensor(probs), atol=0.03)


def test_repetition_penalty_matches_hf_processor():
    logits = _logits(2, seed=3)
    prompt, output = [1, 5, 9, 5], [9, 12, 40]
    spec = SampleSpec(repetition_penalty=1.7, prompt_token_ids=prompt, output_token_ids=output)
    ours = logits.clone()
    apply_penalties(ours, [spec, spec])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output] * 2), logits.clone())
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_follow_openai():
    logits = _logits(1, seed=4)
    spec = SampleSpec(presence_penalty=0.5, frequency_penalty=0.25, prompt_token_ids=[3, 4], output_token_ids=[4, 7, 7])
    ours = logits.clone()
    apply_penalties(ours, [spec])
    expected = logits.clone()
    expected[0, 4] -= 0.5 + 0.25
    expected[0, 7] -= 0.5 + 0.5
    assert torch.allclose(ours, expected)  # prompt-only token 3 untouched


def test_greedy_applies_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 3.0, 2.0
    spec = SampleSpec(repetition_penalty=2.0, output_token_ids=[5], prompt_token_ids=[])
    assert _sample(logits, [spec])[0].token_id == 6


def test_suppressed_ids_are_never_chosen():
    logits = _logits(3, seed=5)
    logits[:, 11] = 100.0
    specs = [SampleSpec(suppress_token_ids=[11]), SampleSpec(temperature=1.0, suppress_token_ids=[11, 2]),
             SampleSpec(num_beam_candidates=4, suppress_token_ids=[11])]
    for _ in range(20):
        samples = _sample(logits, specs)
        assert all(s.token_id != 11 for s in samples)
        assert 11 not in samples[2].beam_token_ids


def test_logprobs_are_raw_log_softmax():
    logits = _logits(4, seed=6)
    specs = [SampleSpec(num_logprobs=5), SampleSpec(temperature=0.5, num_logprobs=3, repetition_penalty=1.5,
                                                   output_token_ids=[1], prompt_token_ids=[2]),
             SampleSpec(temperature=2.0), SampleSpec()]
    reference = logits.log_softmax(dim=-1)
    samples = _sample(logits, specs)
    for row, sample in enumerate(samples):
        assert math.isclose(sample.logprob, reference[row, sample.token_id].item(), abs_tol=1e-5)
        values, ids = reference[row].topk(specs[row].num_logprobs)
        assert sample.top_token_ids == ids.tolist()
        assert sample.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
    assert samples[2].top_token_ids == [] and samples[3].top_logprobs == []


def test_beam_candidates_are_sorted_top_logprobs():
    logits = _logits(2, seed=7)
    logits[1, 3] = logits[1, 9] = logits[1].max() + 0.5  # a tie at the top, broken like torch.topk
    samples = _sample(logits, [SampleSpec(num_beam_candidates=6), SampleSpec(num_beam_candidates=2)])
    reference = logits.log_softmax(dim=-1)
    for row, sample in enumerate(samples):
        values, ids = reference[row].topk(len(sample.beam_token_ids))
        assert sample.beam_token_ids == ids.tolist()
        assert sample.beam_logprobs == sorted(sample.beam_logprobs, reverse=True)
        assert sample.beam_logprobs == pytest.approx(values.tolist(), abs=1e-6)
        assert sample.token_id == sample.beam_token_ids[0]
        assert sample.logprob == pytest.approx(sample.beam_logprobs[0], abs=1e-6)
    assert len(samples[0].beam_token_ids) == 6


def test_beam_candidates_and_logprobs_never_exceed_the_vocabulary():
    suppressed = list(range(10))
    samples = _sample(_logits(1), [SampleSpec(num_beam_candidates=4 * VOCAB, num_logprobs=VOCAB + 5,
                                              suppress_token_ids=suppressed)])
    assert sorted(samples[0].beam_token_ids) == list(range(10, VOCAB))
    assert len(samples[0].top_token_ids) == VOCAB


def test_a_failing_row_fails_alone_and_the_others_keep_their_tokens():
    logits = _logits(3, seed=11)
    specs = [SampleSpec(temperature=0.7, seed=5), SampleSpec(temperature=1.0, top_p=0.0), SampleSpec()]
    samples, failures = Sampler(seed=0).sample_isolating_failures(logits, specs, [10, 11, 12], [4, 4, 4])
    assert [failure.seq_id for failure in failures] == [11] and "top_p" in failures[0].message
    alone = [_sample(logits[row:row + 1], [specs[row]], [4])[0] for row in (0, 2)]
    assert [(s.seq_id, s.token_id) for s in samples] == [(10, alone[0].token_id), (12, alone[1].token_id)]


def test_invalid_spec_is_rejected():
    with pytest.raises(SamplerError, match="top_p"):
        _sample(_logits(1), [SampleSpec(temperature=1.0, top_p=0.0)])
    with pytest.raises(SamplerError, match="rows"):
        Sampler().sample(_logits(2), [SampleSpec()], [0], [0])
