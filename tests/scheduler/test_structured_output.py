"""Structured output in the scheduler, torch-free: matchers, masks, the compiler's cache and
errors, and randomized workloads of constrained requests through forks (n > 1), preemption by
swap and recompute, prefix-cache hits, chunked prefill, aborts, worker restarts and n-gram
speculation. The digest worker samples the best token its row's bitmask allows, so every
output must be valid for its constraint, each matcher must have consumed exactly its sequence's
real outputs after every step, and the tokens must equal those of an unpressured run."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_harness import EOS_TOKEN_ID, VOCAB_SIZE, RequestSpec, digest_worker, run_workload
from structured_vocab import compiler, text_of, token_ids

from pagedserve.contracts.constraint import Constraint, ConstraintKind
from pagedserve.contracts.request_types import Continuation, FinishReason, Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.errors import RequestRejected
from pagedserve.scheduler.core.request_intake import max_group_blocks
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.structured_output.bitmask import allowed_token_ids, mask_rows, num_words
from pagedserve.scheduler.structured_output.compiler import GrammarCompiler, GrammarError
from pagedserve.scheduler.structured_output.matcher import MatcherError, SequenceMatcher

REGEX = Constraint(ConstraintKind.REGEX, "(ab|ba)+c")
CHOICE = Constraint(ConstraintKind.CHOICE, choices=("abc", "ba", "cab"))
ARRAY_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}
OBJECT_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["ab", "xy", 3]}},
                 "required": ["a"], "additionalProperties": False}
CONSTRAINTS = [REGEX, CHOICE, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ARRAY_SCHEMA)),
               Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(OBJECT_SCHEMA)),
               Constraint(ConstraintKind.JSON_OBJECT)]
GRAMMARS = compiler()


def _allowed(matcher: SequenceMatcher) -> set[str]:
    return {text_of([token]) or "<eos>" for token in allowed_token_ids(mask_rows(matcher, VOCAB_SIZE, []), VOCAB_SIZE)}


# -- matcher and masks ----------------------------------------------------------------------------

def test_masks_follow_the_regex_and_force_eos_at_the_end():
    matcher = SequenceMatcher(GRAMMARS.new_matcher(REGEX))
    assert _allowed(matcher) == {"a", "b"}
    matcher.consume(token_ids("ab"))
    assert _allowed(matcher) == {"a", "b", "c"}
    matcher.consume(token_ids("c"))
    assert _allowed(matcher) == {"<eos>"} and matcher.is_complete
    with pytest.raises(MatcherError):
        SequenceMatcher(GRAMMARS.new_matcher(REGEX)).consume(token_ids("c"))


def test_draft_masks_are_the_masks_after_each_draft_and_leave_the_matcher_as_it_was():
    matcher = SequenceMatcher(GRAMMARS.new_matcher(REGEX))
    drafts = token_ids("abba")
    rows = np.frombuffer(mask_rows(matcher, VOCAB_SIZE, drafts), dtype=np.int32).reshape(5, num_words(VOCAB_SIZE))
    for offset in range(5):
        step = SequenceMatcher(GRAMMARS.new_matcher(REGEX))
        step.consume(drafts[:offset]) if offset else None
        assert rows[offset].tobytes() == mask_rows(step, VOCAB_SIZE, []), offset
    assert matcher.num_consumed == 0 and _allowed(matcher) == {"a", "b"}
    assert matcher.valid_draft_prefix(token_ids("abcab")) == 3
    assert matcher.valid_draft_prefix(token_ids("c")) == 0


def test_forks_and_replays_are_independent_and_equal():
    matcher = SequenceMatcher(GRAMMARS.new_matcher(CHOICE))
    matcher.consume(token_ids("c"))
    fork = matcher.fork()
    fork.consume(token_ids("ab"))
    assert _allowed(matcher) == {"a"} and _allowed(fork) == {"<eos>"}
    replayed = SequenceMatcher(GRAMMARS.new_matcher(CHOICE))
    replayed.catch_up(token_ids("cab"))
    assert replayed.num_consumed == 3 and _allowed(replayed) == {"<eos>"}


def test_compiled_grammars_are_cached_by_content_and_errors_name_the_field():
    grammars = compiler()
    first = grammars.template(Constraint(ConstraintKind.REGEX, "x+"))
    assert grammars.template(Constraint(ConstraintKind.REGEX, "x+")) is first
    assert (grammars.num_compiled, grammars.num_cache_hits) == (1, 1)
    grammars.template(Constraint(ConstraintKind.REGEX, "y+"))
    assert grammars.num_compiled == 2
    for constraint, field in [(Constraint(ConstraintKind.REGEX, "(a"), "regex"),
                              (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "strin"}'), "json_schema"),
                              (Constraint(ConstraintKind.JSON_SCHEMA, '{"not": {}}'), "json_schema"),
                              (Constraint(ConstraintKind.GRAMMAR, "start: ??"), "grammar")]:
        with pytest.raises(GrammarError) as raised:
            grammars.template(constraint)
        assert raised.value.field_name == field


def _request(request_id: str, constraint: Constraint | None, **sampling) -> Request:
    return Request(request_id, [5, 6, 7], SamplingParams(constraint=constraint, **sampling), eos_token_ids=[0])


def test_the_scheduler_refuses_what_cannot_compile_or_continue():
    config = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4)
    with pytest.raises(RequestRejected, match="not available"):
        Scheduler(config).add_request(_request("a", REGEX))
    scheduler = Scheduler(config, grammars=GRAMMARS)
    with pytest.raises(RequestRejected, match="regex"):
        scheduler.add_request(_request("b", Constraint(ConstraintKind.REGEX, "(a")))
    broken = _request("c", REGEX, max_tokens=8)
    broken.continuations = [Continuation(0, token_ids("cc"))]
    with pytest.raises(RequestRejected, match="cannot continue"):
        scheduler.add_request(broken)
    assert not scheduler.has_unfinished_requests()


def test_a_resumed_request_replays_its_tokens_and_finishes_the_value():
    config = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4)
    resumed = _Resumed("r", [5, 6, 7], SamplingParams(max_tokens=12, constraint=CHOICE))
    result = run_workload(config, [resumed], grammars=GRAMMARS)
    completion = result.records["r"].completions[0]
    assert text_of(completion.token_ids) == "b" and completion.finish_reason is FinishReason.STOP


class _Resumed(RequestSpec):
    """Resubmitted after its scheduler was lost, with "ca" generated already."""

    def request(self) -> Request:
        request = super().request()
        request.continuations = [Continuation(0, token_ids("ca"))]
        return request


# -- randomized workloads -------------------------------------------------------------------------

_TOKENS = st.integers(1, VOCAB_SIZE - 1)


@st.composite
def _workload(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefix = draw(st.lists(_TOKENS, min_size=4, max_size=24))
    specs = []
    for index in range(draw(st.integers(2, 7))):
        constraint = draw(st.sampled_from([None, *CONSTRAINTS, *CONSTRAINTS]))
        sampling = SamplingParams(max_tokens=draw(st.integers(1, 14)), constraint=constraint,
                                  logprobs=draw(st.sampled_from([0, 2])))
        if draw(st.booleans()):
            sampling.n = draw(st.integers(2, 3))
            sampling.temperature = 1.0
            sampling.seed = draw(st.none() | st.integers(0, 99))
        if constraint is None and draw(st.booleans()):
            sampling.logit_bias = {draw(_TOKENS): -100.0}
        spec = RequestSpec(f"r{index}", draw(st.sampled_from([[], prefix])) + draw(st.lists(_TOKENS, min_size=1,
                                                                                            max_size=12)),
                           sampling, arrival_step=draw(st.integers(0, 4)))
        if draw(st.integers(0, 5)) == 0:
            spec.abort_step = spec.arrival_step + draw(st.integers(0, 10))
        specs.append(spec)
    probe = SchedulerConfig(num_gpu_blocks=1, max_model_len=64, block_size=block_size)
    num_needed = max(max_group_blocks(probe, len(spec.prompt_token_ids), spec.sampling.max_tokens,
                                      spec.sampling.num_completions, False) for spec in specs)
    is_speculating = draw(st.booleans())
    config = SchedulerConfig(
        num_gpu_blocks=num_needed + draw(st.sampled_from([0, 1, 3])), num_cpu_blocks=draw(st.sampled_from([0, 64])),
        block_size=block_size, max_model_len=64, max_num_seqs=draw(st.sampled_from([3, 8])),
        max_num_batched_tokens=draw(st.integers(8, 32)), enable_prefix_caching=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["swap", "recompute", "auto"])),
        speculative_method="ngram" if is_speculating else "none", num_speculative_tokens=3,
        speculative_disable_batch_size=16)
    reset_steps = frozenset(draw(st.lists(st.integers(1, 20), max_size=1)))
    return config, specs, reset_steps


def _check_matchers(scheduler: Scheduler, plan) -> None:
    """After every schedule(): each matcher has consumed exactly its sequence's real outputs."""
    for group in scheduler.running + scheduler.swapped + scheduler.waiting:
        for seq in group.seqs:
            if group.request.sampling.constraint is None:
                assert seq.matcher is None
                continue
            assert seq.matcher.num_consumed == seq.num_output_tokens - seq.num_draft_tokens, group.request_id
    for seq in plan.seqs:
        if seq.num_mask_rows:
            assert seq.num_mask_rows == seq.num_draft_tokens + 1 and seq.sample is not None
            assert len(seq.token_bitmask) == seq.num_mask_rows * 4 * num_words(VOCAB_SIZE)


def _assert_valid(constraint: Constraint, token_ids_: list[int], finish_reason: FinishReason) -> None:
    """A STOP output is a complete value; any other is a prefix the grammar accepts."""
    body = token_ids_[:-1] if finish_reason is FinishReason.STOP else token_ids_
    assert EOS_TOKEN_ID not in body
    if finish_reason is not FinishReason.STOP:
        SequenceMatcher(GRAMMARS.new_matcher(constraint)).consume(body)  # raises if refused
        return
    assert token_ids_[-1] == EOS_TOKEN_ID
    text = text_of(body)
    if constraint.kind is ConstraintKind.REGEX:
        assert re.fullmatch(constraint.value, text), text
    elif constraint.kind is ConstraintKind.CHOICE:
        assert text in constraint.choices
    elif constraint.kind is ConstraintKind.JSON_OBJECT:
        assert isinstance(_json(text), dict), text
    else:
        jsonschema.validate(_json(text), json.loads(constraint.value))


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not JSON: {text!r}") from exc


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_workload())
def test_constrained_workloads_stay_valid_and_match_an_unpressured_run(workload):
    config, specs, reset_steps = workload
    pressured = run_workload(config, specs, reset_steps=reset_steps, on_step=_check_matchers, grammars=GRAMMARS)
    oracle_config = SchedulerConfig(num_gpu_blocks=2048, max_model_len=64, block_size=16, max_num_seqs=64,
                                    max_num_batched_tokens=2048)
    oracle = run_workload(oracle_config, [RequestSpec(s.request_id, s.prompt_token_ids, s.sampling) for s in specs],
                          grammars=GRAMMARS)
    stats = pressured.scheduler.stats()
    event(f"preempted: {stats.num_preemptions_swap + stats.num_preemptions_recompute > 0}")
    event(f"prefix hits: {stats.num_prefix_cache_hits > 0}")
    event(f"speculated: {stats.num_spec_draft_tokens > 0}")
    for spec in specs:
        record = pressured.records[spec.request_id]
        if record.was_aborted:
            continue
        expected = oracle.records[spec.request_id]
        for index, completion in record.completions.items():
            assert completion.token_ids == expected.completions[index].token_ids, (spec.request_id, index)
            if spec.sampling.constraint is not None:
                _assert_valid(spec.sampling.constraint, completion.token_ids, completion.finish_reason)


def test_a_vocabulary_that_cannot_be_read_refuses_constraints_with_the_reason():
    calls = []

    def broken():
        calls.append(1)
        raise OSError("no tokenizer.json")

    grammars = GrammarCompiler(broken)
    for _ in range(2):
        with pytest.raises(GrammarError, match="not available.*no tokenizer.json"):
            grammars.template(REGEX)
    assert len(calls) == 1  # read once


def test_deferred_masks_equal_the_masks_computed_with_the_plan():
    """The engine publishes the plan first and computes the rows while the workers run it."""
    config = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4, speculative_method="ngram",
                             num_speculative_tokens=3)
    plans = {}
    for defer in (False, True):
        scheduler = Scheduler(config, grammars=GRAMMARS)
        worker = digest_worker(config)
        scheduler.add_request(Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=12, n=2, temperature=1.0,
                                                                           seed=3, constraint=REGEX), [0]))
        scheduler.add_request(Request("u", [4, 5], SamplingParams(max_tokens=6), [0]))
        plans[defer] = []
        while (step := scheduler.schedule(defer_masks=defer)) is not None:
            assert step.plan.masks_follow == (defer and bool(step.pending_masks))
            if defer:
                assert all(not seq.token_bitmask for seq in step.plan.seqs)
                step.fill_masks()
            plans[defer].append([(seq.seq_id, seq.num_mask_rows, seq.token_bitmask) for seq in step.plan.seqs])
            scheduler.process_result(step, worker.run(step.plan))
    assert plans[True] == plans[False] and any(rows for plan in plans[True] for _, rows, _ in plan)
