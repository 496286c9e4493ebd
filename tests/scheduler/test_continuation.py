"""A request resubmitted with continuations (its scheduler was lost after streaming some tokens)
continues on a fresh scheduler exactly where it was: the same tokens, finish reasons and
cumulative logprobs as an undisturbed run, with max_tokens, min_tokens, stops and penalties
counting the tokens generated before."""

from __future__ import annotations

import pytest
from scheduler_harness import EOS_TOKEN_ID, RequestRecord, collect, digest_worker

from pagedserve.testing.digest_worker import DigestWorker
from pagedserve.contracts.request_types import Continuation, FinishReason, Request
from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.scheduler.core.errors import RequestRejected
from pagedserve.scheduler.core.scheduler import Scheduler
from pagedserve.scheduler.core.config import SchedulerConfig

PROMPT = [3, 5, 7, 9, 11, 13, 15]


def _config(**overrides) -> SchedulerConfig:
    arguments = {"num_gpu_blocks": 256, "max_model_len": 2048, "block_size": 4, "num_cpu_blocks": 64,
                 "max_num_seqs": 16, "max_num_batched_tokens": 64} | overrides
    return SchedulerConfig(**arguments)


def _request(request_id: str, continuations: list[Continuation] | None = None, **sampling) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(PROMPT), sampling=SamplingParams(**sampling),
                   eos_token_ids=[EOS_TOKEN_ID], continuations=continuations or [])


def _run(config: SchedulerConfig, request: Request, max_steps: int | None = None,
         replica: tuple[Scheduler, DigestWorker] | None = None) -> tuple[RequestRecord, Scheduler]:
    """Runs request alone (for max_steps steps, or to its end), on a fresh scheduler and worker
    unless replica gives them."""
    scheduler, worker = replica or (Scheduler(config), digest_worker(config))
    record = RequestRecord()
    records = {request.request_id: record}
    scheduler.add_request(request)
    num_steps = 0
    while scheduler.has_unfinished_requests() and (max_steps is None or num_steps < max_steps):
        step = scheduler.schedule()
        assert step is not None
        collect(records, scheduler.process_result(step, worker.run(step.plan)))
        scheduler.check_invariants()
        num_steps += 1
    return record, scheduler


def _continuations(record: RequestRecord) -> list[Continuation]:
    return [Continuation(index=index, token_ids=list(completion.token_ids),
                         is_finished=completion.finish_reason is not None,
                         cumulative_logprob=completion.cumulative_logprob)
            for index, completion in sorted(record.completions.items())]


SAMPLINGS = {
    "greedy": {"max_tokens": 24, "ignore_eos": True},
    "seeded": {"max_tokens": 24, "temperature": 0.8, "seed": 1234, "ignore_eos": True},
    "eos_after_min_tokens": {"max_tokens": 40, "min_tokens": 12},
    "stop_token_ids": {"max_tokens": 40, "stop_token_ids": [5, 6], "ignore_eos": True},
    "penalties": {"max_tokens": 24, "repetition_penalty": 1.3, "presence_penalty": 0.5,
                  "frequency_penalty": 0.25, "ignore_eos": True},
    "parallel_samples": {"max_tokens": 24, "n": 3, "temperature": 1.0, "seed": 7},
    "parallel_samples_with_min_tokens": {"max_tokens": 30, "n": 4, "min_tokens": 6},
}


@pytest.mark.parametrize("num_steps_before", [1, 2, 5, 11])
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_continuation_gives_the_undisturbed_tokens(name: str, num_steps_before: int) -> None:
    config = _config()
    sampling = SAMPLINGS[name]
    undisturbed, _ = _run(config, _request("r", **sampling))
    before, lost = _run(config, _request("r", **sampling), max_steps=num_steps_before)
    if before.is_finished:
        assert before.completions == undisturbed.completions
        return  # nothing left to continue (the frontend resubmits only unfinished requests)

    after, fresh = _run(config, _request("r", _continuations(before), **sampling))
    assert after.is_finished
    for index, completion in undisturbed.completions.items():
        earlier = before.completions.get(index)
        if earlier is not None and earlier.finish_reason is not None:
            assert index not in after.completions, "a finished completion was resumed"
            assert earlier == completion
            continue
        later = after.completions[index]
        tokens = (earlier.token_ids if earlier else []) + later.token_ids
        assert tokens == completion.token_ids, index
        assert later.finish_reason == completion.finish_reason
        assert later.cumulative_logprob == pytest.approx(completion.cumulative_logprob)
    stats = fresh.stats()
    assert stats.gpu.num_used == 0 and stats.gpu.num_free + stats.gpu.num_cached == stats.gpu.num_total


def test_continuation_sees_generated_tokens_as_outputs_and_reports_the_prompt_alone() -> None:
    config = _config()
    sampling = {"max_tokens": 20, "repetition_penalty": 1.5, "min_tokens": 10, "ignore_eos": False}
    before, _ = _run(config, _request("r", **sampling), max_steps=4)
    generated = before.completions[0].token_ids
    assert 0 < len(generated) < 10
    scheduler = Scheduler(config)
    scheduler.add_request(_request("r", [Continuation(0, list(generated))], **sampling))
    step = scheduler.schedule()
    (seq,) = step.plan.seqs
    assert seq.start_position == 0 and seq.token_ids == PROMPT + generated
    assert seq.sample.prompt_token_ids == PROMPT
    assert seq.sample.output_token_ids == generated
    assert seq.sample.suppress_token_ids == [EOS_TOKEN_ID], "min_tokens counts the generated tokens"
    outputs = scheduler.process_result(step, digest_worker(config).run(step.plan))
    assert outputs[0].prompt_tokens == len(PROMPT)


def test_finished_completions_are_not_resumed() -> None:
    config = _config()
    request = _request("r", [Continuation(0, [4, 4, 4], is_finished=True), Continuation(2, [8], is_finished=True),
                             Continuation(3, [9, 10])], max_tokens=6, n=4, ignore_eos=True)
    record, _ = _run(config, request)
    assert sorted(record.completions) == [1, 3]
    assert len(record.completions[1].token_ids) == 6
    assert len(record.completions[3].token_ids) == 4  # 2 before, 4 more: max_tokens
    assert record.completions[3].finish_reason is FinishReason.LENGTH
    assert record.is_finished


def test_cached_prompt_tokens_never_count_generated_tokens() -> None:
    config = _config()
    generated = list(range(1, 13))  # three full blocks past the prompt
    replica = (Scheduler(config), digest_worker(config))
    first, _ = _run(config, _request("a", [Continuation(0, generated)], max_tokens=16, ignore_eos=True),
                    replica=replica)
    again, _ = _run(config, _request("b", [Continuation(0, generated)], max_tokens=16, ignore_eos=True),
                    replica=replica)
    assert first.cached_prompt_tokens == 0
    assert again.cached_prompt_tokens == len(PROMPT)  # 16 cached tokens, 7 of them the prompt
    assert again.completions[0].token_ids == first.completions[0].token_ids


@pytest.mark.parametrize("continuations, sampling, reason", [
    ([Continuation(0, [1, 2])], {"beam_width": 2, "max_tokens": 8}, "beam search"),
    ([Continuation(2, [1])], {"n": 2}, "outside"),
    ([Continuation(0, [1]), Continuation(0, [1])], {"n": 2}, "twice"),
    ([Continuation(0, [1, 2, 3, 4])], {"max_tokens": 4}, "max_tokens"),
    ([Continuation(0, [1, 2, 3, 4, 5], is_finished=True)], {"max_tokens": 4}, "max_tokens"),
    ([Continuation(0, [1], is_finished=True), Continuation(1, [2], is_finished=True)], {"n": 2}, "nothing"),
])
def test_continuations_that_no_run_could_have_made_are_rejected(continuations, sampling, reason) -> None:
    with pytest.raises(RequestRejected, match=reason):
        Scheduler(_config()).add_request(_request("r", continuations, **sampling))
