"""Speculative decoding in the scheduler (n-gram proposals verified by the digest worker): the
same tokens as a run without speculation under every kind of pressure, block invariants after
every step, no prefix-cache key over a rejected token, accepted <= proposed."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from scheduler_harness import RequestSpec, run_workload
from test_scheduler_properties import _HEALTH, _ORACLE, _oracle_specs, _workload

from pagedserve.prefix_hash import hash_block
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler.errors import SchedulerConfigError
from pagedserve.scheduler.ngram_proposer import propose_ngram
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.scheduler_config import SchedulerConfig
from pagedserve.scheduler.sequence import Sequence
from pagedserve.scheduler.spec_drafting import MAX_PAUSE_STEPS, record_verification

SMALL_VOCAB = 5  # the worker's tokens repeat often, so proposals are often accepted


def test_ngram_proposals() -> None:
    tokens = [1, 2, 3, 8, 2, 3, 9, 1, 2, 3]
    assert propose_ngram(tokens, ngram_min=2, ngram_max=4, max_num_tokens=2) == [8, 2]  # "1 2 3" beats "2 3"
    assert propose_ngram(tokens, ngram_min=1, ngram_max=2, max_num_tokens=3) == [9, 1, 2]  # latest "2 3"
    assert propose_ngram(tokens, ngram_min=4, ngram_max=4, max_num_tokens=3) == []
    assert propose_ngram([4, 5, 6], ngram_min=1, ngram_max=3, max_num_tokens=3) == []
    assert propose_ngram(tokens, ngram_min=1, ngram_max=3, max_num_tokens=0) == []


def test_draft_method_is_accepted_and_ngram_bounds_are_checked() -> None:
    config = SchedulerConfig(num_gpu_blocks=8, max_model_len=64, speculative_method="draft")
    assert config.is_speculating and config.is_draft_model_speculation
    assert not SchedulerConfig(num_gpu_blocks=8, max_model_len=64, speculative_method="ngram").is_draft_model_speculation
    with pytest.raises(SchedulerConfigError, match="speculative_method"):
        SchedulerConfig(num_gpu_blocks=8, max_model_len=64, speculative_method="eagle")
    with pytest.raises(SchedulerConfigError, match="ngram_max"):
        SchedulerConfig(num_gpu_blocks=8, max_model_len=64, speculative_method="ngram", ngram_min=3, ngram_max=2)


def _real_keys(scheduler: Scheduler, keys: set[bytes]) -> None:
    """Adds the prefix keys of every live sequence's real tokens (drafts left out)."""
    size = scheduler.block_manager.block_size
    for group in scheduler.running + scheduler.swapped + scheduler.waiting:
        for seq in group.seqs:
            tokens = seq.token_ids[:len(seq.token_ids) - seq.num_draft_tokens]
            parent = None
            for start in range(0, len(tokens) - size + 1, size):
                parent = hash_block(parent, tokens[start:start + size])
                keys.add(parent)


def _prefix_keys(tokens: list[int], size: int) -> set[bytes]:
    keys, parent = set(), None
    for start in range(0, len(tokens) - size + 1, size):
        parent = hash_block(parent, tokens[start:start + size])
        keys.add(parent)
    return keys


def _speculating(config: SchedulerConfig, num_tokens: int, disable_batch_size: int) -> SchedulerConfig:
    return dataclasses.replace(config, speculative_method="ngram", num_speculative_tokens=num_tokens,
                               ngram_min=1, ngram_max=3, speculative_disable_batch_size=disable_batch_size)


@settings(max_examples=120, deadline=None, suppress_health_check=_HEALTH)
@given(_workload(), st.integers(1, 5), st.sampled_from([0, 4, 64]))
def test_speculation_gives_the_tokens_of_plain_decoding(workload, num_tokens, disable_batch_size) -> None:
    config, specs, reset_steps = workload
    config = _speculating(config, num_tokens, disable_batch_size)
    real_keys: set[bytes] = set()
    num_draft_steps = 0

    def check_keys(scheduler: Scheduler, plan) -> None:
        nonlocal num_draft_steps
        num_draft_steps += any(seq.num_draft_tokens for seq in plan.seqs)
        for seq in plan.seqs:  # only sampling, non-beam sequences of a small enough batch draft
            assert not seq.num_draft_tokens or seq.sample is not None and not seq.sample.num_beam_candidates
        _real_keys(scheduler, real_keys)
        # a key registered by the last step of a request that ended since is checked at the end
        unseen_keys.update(set(scheduler.block_manager.gpu_pool.key_map()) - real_keys)

    unseen_keys: set[bytes] = set()
    speculated = run_workload(config, specs, reset_steps=reset_steps, on_step=check_keys, vocab_size=SMALL_VOCAB)
    for spec in specs:  # the tokens a request ended with: its prompt and its delivered outputs
        for completion in speculated.records[spec.request_id].completions.values():
            real_keys.update(_prefix_keys(spec.prompt_token_ids + completion.token_ids,
                                          config.block_size))
    stale = unseen_keys - real_keys
    assert not stale, "a prefix-cache key covers tokens that are not the sequence's own"
    plain = run_workload(_ORACLE, _oracle_specs(specs), vocab_size=SMALL_VOCAB)
    stats = speculated.scheduler.stats()
    assert stats.num_spec_accepted_tokens <= stats.num_spec_draft_tokens
    assert stats.num_spec_unspeculated_requests == sum(spec.sampling.is_beam_search for spec in specs)
    assert sum(stats.num_spec_accepted_per_position) == stats.num_spec_accepted_tokens
    assert stats.num_spec_drafts == 0 or stats.num_spec_draft_tokens >= stats.num_spec_drafts
    event(f"drafted: {num_draft_steps > 0}; accepted: {stats.num_spec_accepted_tokens > 0}")
    event(f"preempted: {stats.num_preemptions_swap + stats.num_preemptions_recompute > 0}")
    for spec in specs:
        record, expected = speculated.records[spec.request_id], plain.records[spec.request_id]
        if record.was_aborted:
            for index, completion in record.completions.items():
                assert completion.token_ids == expected.completions[index].token_ids[:len(completion.token_ids)]
            continue
        for index, completion in expected.completions.items():
            if index in record.finished_indices:
                continue
            got = record.completions[index]
            assert got.token_ids == completion.token_ids, (spec.request_id, index)
            assert got.finish_reason == completion.finish_reason
            assert got.num_logprobs == completion.num_logprobs
            assert got.cumulative_logprob == pytest.approx(completion.cumulative_logprob)


def test_a_repetitive_request_accepts_proposals_and_saves_steps() -> None:
    config = SchedulerConfig(num_gpu_blocks=64, max_model_len=128, block_size=4)
    spec = RequestSpec("r", [1, 2, 3, 4] * 4, SamplingParams(max_tokens=40, ignore_eos=True))
    plain = run_workload(config, [spec], vocab_size=2)
    speculated = run_workload(_speculating(config, 4, 8), [spec], vocab_size=2)
    assert speculated.records["r"].completions[0].token_ids == plain.records["r"].completions[0].token_ids
    stats = speculated.scheduler.stats()
    assert stats.num_spec_accepted_tokens > 0
    assert len(speculated.plans) < len(plain.plans)
    drafted = [seq for plan in speculated.plans for seq in plan.seqs if seq.num_draft_tokens]
    assert all(len(seq.token_ids) == seq.num_draft_tokens + 1 for seq in drafted)


def test_a_sequence_whose_proposals_miss_pauses_longer_each_time() -> None:
    seq = Sequence(seq_id=0, output_index=0, token_ids=[1, 2, 3], num_prompt_tokens=3)
    pauses = []
    for _ in range(5):
        record_verification(seq, 0)
        pauses.append(seq.num_spec_pauses_left)
    assert pauses == [1, 2, 4, MAX_PAUSE_STEPS, MAX_PAUSE_STEPS]
    record_verification(seq, 1)
    record_verification(seq, 0)
    assert seq.num_spec_pauses_left == 1  # an accepted draft starts the back-off over
