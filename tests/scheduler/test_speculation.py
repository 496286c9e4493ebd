"""Speculative decoding in the scheduler (n-gram proposals, or placeholders the digest worker's
fake draft model fills, verified by the digest worker): the same tokens as a run without
speculation under every kind of pressure, block invariants after every step, no prefix-cache key
over a rejected token, accepted <= proposed. With a draft model the digest worker also checks,
for every drafting sequence, that the draft KV the scheduler counts as computed is there."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from scheduler_harness import RequestSpec, run_workload
from test_scheduler_properties import _HEALTH, _ORACLE, _oracle_specs, _workload

from pagedserve.testing.digest_worker import DigestWorkerError
from pagedserve.contracts.prefix_hash import hash_block
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.errors import SchedulerConfigError
from pagedserve.scheduler.speculation.ngram_proposer import propose_ngram
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import Sequence
from pagedserve.scheduler.speculation.drafting import MAX_PAUSE_STEPS, record_verification

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


def _speculating(config: SchedulerConfig, num_tokens: int, disable_batch_size: int,
                 method: str = "ngram") -> SchedulerConfig:
    return dataclasses.replace(config, speculative_method=method, num_speculative_tokens=num_tokens,
                               ngram_min=1, ngram_max=3, speculative_disable_batch_size=disable_batch_size)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@settings(max_examples=120, deadline=None, suppress_health_check=_HEALTH)
@given(workload=_workload(), num_tokens=st.integers(1, 5), disable_batch_size=st.sampled_from([0, 4, 64]))
def test_speculation_gives_the_tokens_of_plain_decoding(method, workload, num_tokens, disable_batch_size) -> None:
    _check_speculation(method, *workload, num_tokens, disable_batch_size)


@settings(max_examples=40, deadline=None, suppress_health_check=_HEALTH)
@given(workload=_workload(is_crowded=True), num_tokens=st.integers(1, 5))
def test_draft_model_speculation_in_crowded_workloads(workload, num_tokens) -> None:
    """Many long requests at once, nothing to spare: drafting sequences are preempted (swap and
    recompute) and come back, so their draft KV is computed again from scratch."""
    _check_speculation("draft", *workload, num_tokens, 64)


def _check_speculation(method: str, config: SchedulerConfig, specs: list[RequestSpec], reset_steps: frozenset[int],
                       num_tokens: int, disable_batch_size: int) -> None:
    config = _speculating(config, num_tokens, disable_batch_size, method)
    real_keys: set[bytes] = set()
    num_draft_steps = 0
    num_catch_ups = 0  # drafting sequences whose draft context starts past position 0

    def check_keys(scheduler: Scheduler, plan) -> None:
        nonlocal num_draft_steps, num_catch_ups
        num_draft_steps += any(seq.num_draft_tokens for seq in plan.seqs)
        assert plan.drafts_from_worker == (method == "draft")
        for seq in plan.seqs:  # only sampling, non-beam sequences of a small enough batch draft
            assert not seq.num_draft_tokens or seq.sample is not None and not seq.sample.num_beam_candidates
            if plan.drafts_from_worker and seq.num_draft_tokens:
                assert seq.draft_start_position + len(seq.draft_context_ids) == seq.start_position
                num_catch_ups += seq.draft_start_position > 0
            else:
                assert not seq.draft_context_ids
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
    event(f"some accepted, some rejected: {0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens}")
    if method == "draft":
        event(f"draft KV reused from an earlier step: {num_catch_ups > 0}")
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


def _draft_positions(plans, seq_id: int) -> list[tuple[int, int]]:
    """(position of t, draft_start_position) of every step in which seq_id drafted."""
    return [(seq.start_position, seq.draft_start_position) for plan in plans for seq in plan.seqs
            if seq.seq_id == seq_id and seq.num_draft_tokens]


def test_the_draft_context_holds_only_what_the_draft_model_has_not_computed() -> None:
    config = _speculating(SchedulerConfig(num_gpu_blocks=64, max_model_len=128, block_size=4), 3, 8, "draft")
    spec = RequestSpec("r", [1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
    plain = run_workload(SchedulerConfig(num_gpu_blocks=64, max_model_len=128, block_size=4), [spec],
                         vocab_size=SMALL_VOCAB)
    speculated = run_workload(config, [spec], vocab_size=SMALL_VOCAB, reset_steps=frozenset({12}))
    assert speculated.records["r"].completions[0].token_ids == plain.records["r"].completions[0].token_ids
    stats = speculated.scheduler.stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    positions = _draft_positions(speculated.plans, 0)
    assert positions[0] == (len(spec.prompt_token_ids), 0)  # the first draft forward covers the prompt
    resets = [index for index, (position, start) in enumerate(positions) if start == 0]
    assert len(resets) == 2  # the first step and the first one after the workers' reset
    assert positions[resets[1]][0] > len(spec.prompt_token_ids)
    for index in range(1, len(positions)):
        if index != resets[1]:  # afterwards the draft KV reaches past the previous drafting step's t
            assert positions[index - 1][0] < positions[index][1] <= positions[index][0]


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_a_preempted_drafting_sequence_computes_its_draft_kv_again(preemption_mode) -> None:
    config = _speculating(SchedulerConfig(num_gpu_blocks=14, num_cpu_blocks=64, max_model_len=128, block_size=4,
                                          preemption_mode=preemption_mode), 3, 8, "draft")
    specs = [RequestSpec(f"r{index}", [1 + index, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
             for index in range(2)]
    speculated = run_workload(config, specs, vocab_size=SMALL_VOCAB)
    plain = run_workload(_ORACLE, _oracle_specs(specs), vocab_size=SMALL_VOCAB)
    for spec in specs:
        assert speculated.records[spec.request_id].completions[0].token_ids == \
            plain.records[spec.request_id].completions[0].token_ids
    stats = speculated.scheduler.stats()
    assert getattr(stats, f"num_preemptions_{preemption_mode}") > 0
    restarts = [(position, start) for seq_id in (0, 1) for position, start in _draft_positions(speculated.plans, seq_id)
                if start == 0 and position > len(specs[0].prompt_token_ids)]
    assert restarts, "no drafting sequence started its draft KV over after a preemption"


def test_the_digest_worker_refuses_a_draft_context_that_skips_missing_draft_kv() -> None:
    """The check the tests above rely on: a plan that claims draft KV the draft model never wrote fails."""
    config = _speculating(SchedulerConfig(num_gpu_blocks=64, max_model_len=128, block_size=4), 3, 8, "draft")
    spec = RequestSpec("r", [1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))

    def skip_first_context_token(scheduler: Scheduler, plan) -> None:
        for seq in plan.seqs:
            if seq.draft_context_ids:
                del seq.draft_context_ids[0]
                seq.draft_start_position += 1

    with pytest.raises(DigestWorkerError, match="lacks the draft KV of its tokens"):
        run_workload(config, [spec], vocab_size=SMALL_VOCAB, on_step=skip_first_context_token)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_penalty_history_leaves_out_the_proposals_in_flight(method) -> None:
    """The worker adds the drafts before each verified row itself (worker/speculation/ngram_verify.py)."""
    config = _speculating(SchedulerConfig(num_gpu_blocks=64, max_model_len=128, block_size=4), 3, 8, method)
    spec = RequestSpec("r", [1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=0.5))
    histories = []

    def record(scheduler: Scheduler, plan) -> None:
        for seq in plan.seqs:
            if seq.num_draft_tokens:
                (group,) = scheduler.running
                real = group.seqs[0].token_ids[:len(group.seqs[0].token_ids) - seq.num_draft_tokens]
                histories.append((seq.sample.output_token_ids, real[len(spec.prompt_token_ids):]))

    run_workload(config, [spec], vocab_size=2, on_step=record)
    assert histories
    for sent, outputs in histories:
        assert sent == outputs
