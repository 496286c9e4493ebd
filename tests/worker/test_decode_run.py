"""The decode run kept between plans (worker/decode_run.py) against the full step: two runners on
the same checkpoint, one executing every plan in full (ModelRunner._execute_step), the other
through ModelRunner.execute, which takes the kept run where the plan qualifies; both get the same
plans, and every sample (token and log probability) must be equal bit for bit."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from gguf_fixtures import write_all_kept
from tiny_models import make_prompts

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan
from pagedserve.kernels import ops
from pagedserve.kernels.linear import native_rows
from pagedserve.kernels.native import library as native_lib
from pagedserve.worker import model_runner as model_runner_module
from pagedserve.worker.continuation import next_plan, run_steps
from pagedserve.worker.model_input import PlanError
from pagedserve.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    native_lib.load() is None or native_rows.supports(torch.zeros(1, 2, dtype=torch.bfloat16),
                                                          torch.zeros(2, 2, dtype=torch.bfloat16)) is None,
    reason="needs a C compiler and AVX-512 BF16")

BLOCK = 16
BUILD = model_runner_module.build_model_input


def _runner(path, dtype: str = "bfloat16", quantization: str = "auto") -> ModelRunner:
    runner = ModelRunner(path, device="cpu", dtype=dtype, block_size=BLOCK, quantization=quantization)
    runner.load()
    runner.init_cache(64, 0)
    return runner


def _prefill(runners, prompts, tables, spec):
    plan = StepPlan(step_id=0, seqs=[ScheduledSeq(i, prompt, 0, table, spec)
                                     for i, (prompt, table) in enumerate(zip(prompts, tables))])
    results = [runner._execute_step(plan) for runner in runners]
    assert results[0].samples == results[1].samples
    tokens = {sample.seq_id: sample.token_id for sample in results[0].samples}
    return StepPlan(step_id=1, continuable=True, seqs=[
        ScheduledSeq(i, [tokens[i]], len(prompt), table, spec) for i, (prompt, table) in enumerate(zip(prompts, tables))])


def _decode(full: ModelRunner, kept: ModelRunner, plan: StepPlan, num_steps: int, monkeypatch=None):
    """num_steps plans, each the one next_plan derives, through both runners: the samples of each,
    and the plan that follows the last (None when next_plan derives none)."""
    samples = []
    for _ in range(num_steps):
        expected = full._execute_step(plan)
        got = kept.execute(plan)
        assert got.samples == expected.samples
        assert got.step_id == plan.step_id and got.epoch == plan.epoch and not got.failures
        samples.append(got.samples)
        plan = next_plan(plan, got, BLOCK)
        if plan is None:
            break
    return samples, plan


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied"])
@pytest.mark.parametrize("lengths", [(20,), (5, 40), (9, 17, 31, 50)])
def test_kept_run_gives_the_full_steps_samples(checkpoint_dir, monkeypatch, name, lengths):
    """The kept run's samples equal the full step's; once started, no plan of the run builds the
    step's input (each is a step of the kept run), and the run is the same object throughout."""
    path = checkpoint_dir(name)
    full, kept = _runner(path), _runner(path)
    prompts = make_prompts(seed=len(lengths), lengths=lengths)
    # each sequence's blocks up to the end of the block after the one its first decode falls in
    tables = [[8 * i + j for j in range(len(prompt) // BLOCK + 2)] for i, prompt in enumerate(prompts)]
    plan = _prefill((full, kept), prompts, tables, SampleSpec())
    room = min(2 * BLOCK - len(prompt) % BLOCK for prompt in prompts)
    samples, plan = _decode(full, kept, plan, 1)
    run = kept._decode_run
    assert run is not None
    built = []
    monkeypatch.setattr(model_runner_module, "build_model_input",
                        lambda *args, **kwargs: built.append(1) or BUILD(*args, **kwargs))
    more, _ = _decode(full, kept, plan, room - 1)  # the full runner builds one input per step
    assert len(more) == room - 1 and len(built) == room - 1
    assert kept._decode_run is run


def test_a_table_that_grows_keeps_the_run_with_the_same_samples(checkpoint_dir):
    """Crossing a block boundary the plans carry one more block: the run keeps the sequence's row,
    the new block written into its kept table, and gives the full step's samples; a table that
    changes otherwise starts another run."""
    path = checkpoint_dir("llama-gqa-untied")
    full, kept = _runner(path), _runner(path)
    prompt = make_prompts(seed=3, lengths=(13,))[0]
    table = [4, 9, 2]
    plan = _prefill((full, kept), [prompt], [table[:1]], SampleSpec())
    runs = []
    for _ in range(30):
        expected = full._execute_step(plan)
        got = kept.execute(plan)
        assert got.samples == expected.samples
        runs.append(kept._decode_run)
        position = plan.seqs[0].start_position + 1
        plan = StepPlan(step_id=plan.step_id + 1, seqs=[ScheduledSeq(
            0, [got.samples[0].token_id], position, table[:position // BLOCK + 1], plan.seqs[0].sample)])
    assert runs[0] is not None and all(run is runs[0] for run in runs)  # blocks 0, 1 and 2
    assert runs[0].tables == [table]
    moved = StepPlan(step_id=plan.step_id, seqs=[ScheduledSeq(0, plan.seqs[0].token_ids, plan.seqs[0].start_position,
                                                              [4, 7, 2], plan.seqs[0].sample)])
    full.cache.copy([(9, 7)])  # the sequence's second block moved: its KV where the table says
    kept.cache.copy([(9, 7)])
    assert kept.execute(moved).samples == full._execute_step(moved).samples
    assert kept._decode_run is not runs[0] and kept._decode_run.tables == [[4, 7, 2]]


@pytest.mark.parametrize("spec", [SampleSpec(temperature=0.8, seed=3), SampleSpec(num_logprobs=2),
                                  SampleSpec(logit_bias={5: 3.0}), SampleSpec(repetition_penalty=1.3)],
                         ids=["sampled", "logprobs", "logit-bias", "penalty"])
def test_other_specs_take_the_full_step(checkpoint_dir, spec):
    path = checkpoint_dir("llama-gqa-untied")
    full, kept = _runner(path), _runner(path)
    prompt = make_prompts(seed=4, lengths=(10,))[0]
    plan = _prefill((full, kept), [prompt], [[1, 2]], spec)
    _decode(full, kept, plan, 4)
    assert kept._decode_run is None


def test_plans_not_continuable_take_the_run_and_plans_with_operations_the_full_step(checkpoint_dir):
    path = checkpoint_dir("llama-gqa-untied")
    full, kept = _runner(path), _runner(path)
    prompt = make_prompts(seed=6, lengths=(10,))[0]
    plan = _prefill((full, kept), [prompt], [[1, 2]], SampleSpec())
    plan.continuable = False
    samples, _ = _decode(full, kept, plan, 1)
    run = kept._decode_run
    assert run is not None
    seq = plan.seqs[0]
    plan = StepPlan(step_id=plan.step_id + 1, blocks_to_copy=[(5, 6)], seqs=[ScheduledSeq(
        0, [samples[0][0].token_id], seq.start_position + 1, seq.block_table, seq.sample)])
    assert kept.execute(plan).samples == full._execute_step(plan).samples
    assert kept._decode_run is None


def test_many_sequences_give_the_full_steps_samples(checkpoint_dir):
    """Nine sequences (the native step takes them where every projection is packed, else the full
    step runs): the same samples either way."""
    path = checkpoint_dir("qwen2-bias-tied")
    full, kept = _runner(path), _runner(path)
    prompts = make_prompts(seed=9, lengths=(3, 9, 17, 12, 5, 30, 8, 21, 14))
    plan = _prefill((full, kept), prompts, [[2 * i, 2 * i + 1] for i in range(9)], SampleSpec())
    samples, _ = _decode(full, kept, plan, 2)
    assert len(samples) == 2


def test_a_float32_model_takes_the_full_step(checkpoint_dir):
    path = checkpoint_dir("llama-gqa-untied")
    full, kept = _runner(path, "float32"), _runner(path, "float32")
    prompt = make_prompts(seed=7, lengths=(10,))[0]
    plan = _prefill((full, kept), [prompt], [[1, 2]], SampleSpec())
    _decode(full, kept, plan, 3)
    assert kept._decode_run is None


def test_unbound_head_and_greedy_give_the_same_samples(checkpoint_dir, monkeypatch):
    """Where the head's kernel or the greedy kernel cannot be bound, the run calls them per step."""
    monkeypatch.setattr(ops, "bound_linear", lambda *args, **kwargs: None)
    monkeypatch.setattr(ops, "bound_greedy", lambda logits: None)
    path = checkpoint_dir("qwen2-bias-tied")
    full, kept = _runner(path), _runner(path)
    prompts = make_prompts(seed=8, lengths=(7, 25))
    plan = _prefill((full, kept), prompts, [[1], [3, 4]], SampleSpec())
    samples, _ = _decode(full, kept, plan, 6)
    assert len(samples) == 6
    assert kept._decode_run is not None and kept._decode_run.native.logits is None


def test_positions_outside_the_blocks_or_the_table_raise_as_the_full_step_does(checkpoint_dir):
    path = checkpoint_dir("llama-gqa-untied")
    full, kept = _runner(path), _runner(path)
    prompt = make_prompts(seed=2, lengths=(10,))[0]
    plan = _prefill((full, kept), [prompt], [[1]], SampleSpec())
    _decode(full, kept, plan, 1)
    assert kept._decode_run is not None
    beyond = StepPlan(step_id=9, continuable=True, seqs=[ScheduledSeq(0, [3], BLOCK, [1], SampleSpec())])
    with pytest.raises(Exception) as expected:
        full.execute(beyond)
    with pytest.raises(type(expected.value)):
        kept.execute(beyond)
    limit = kept.model.max_positions
    table = list(range(-(-(limit + 1) // BLOCK)))
    if len(table) <= kept.cache.num_gpu_blocks:
        past = StepPlan(step_id=10, continuable=True, seqs=[ScheduledSeq(0, [3], limit, table, SampleSpec())])
        with pytest.raises(type(_raised(full, past))):
            kept.execute(past)


def _raised(runner, plan):
    try:
        runner.execute(plan)
    except Exception as exc:
        return exc
    raise AssertionError("the full step did not raise")


def test_init_cache_drops_the_run_and_the_structures_holding_the_old_pool(checkpoint_dir):
    path = checkpoint_dir("llama-gqa-untied")
    full, kept = _runner(path), _runner(path)
    prompt = make_prompts(seed=1, lengths=(12,))[0]
    plan = _prefill((full, kept), [prompt], [[1]], SampleSpec())
    _decode(full, kept, plan, 2)
    assert kept._decode_run is not None
    old = kept.cache.gpu_cache
    kept.init_cache(32, 0)
    assert kept._decode_run is None and kept.model._native_layers is None
    assert all(getattr(layer, "_native_decode", None) is None for layer in kept.model.layers)
    full.init_cache(32, 0)
    plan = _prefill((full, kept), [prompt], [[1]], SampleSpec())
    _decode(full, kept, plan, 2)
    assert kept._decode_run.kv_caches is kept.cache.gpu_cache is not old


@pytest.mark.parametrize("num_seqs", [1, 2])
def test_kept_gguf_blocks_give_the_full_steps_samples(tmp_path_factory, num_seqs):
    """A GGUF file's blocks kept (--quantization auto), its Q8_0 LM head's blocks multiplied by the
    block kernel at one row (bound once, ops.bound_block_quant_linear): the same samples."""
    path = write_all_kept(tmp_path_factory, seed=41)
    full, kept = _runner(path), _runner(path)
    assert kept.model.lm_head.blocks is not None
    prompts = make_prompts(seed=num_seqs, lengths=(11, 26)[:num_seqs])
    plan = _prefill((full, kept), prompts, [[1, 2, 3], [5, 6, 7]][:num_seqs], SampleSpec())
    samples, _ = _decode(full, kept, plan, 8)
    assert len(samples) == 8
    run = kept._decode_run
    assert run is not None and run.native.logits is not None


def test_blocks_outside_the_pool_raise_the_full_steps_error(checkpoint_dir):
    """A table naming a block outside the pool, from the start or as a new block, takes the full step
    and its PlanError, never the kept run's native call."""
    path = checkpoint_dir("llama-gqa-untied")
    full, kept = _runner(path), _runner(path)
    prompt = make_prompts(seed=2, lengths=(15,))[0]
    plan = _prefill((full, kept), [prompt], [[1]], SampleSpec())
    samples, _ = _decode(full, kept, plan, 1)
    run = kept._decode_run
    assert run is not None
    seq = plan.seqs[0]
    for table in ([1, 64], [64, 2]):  # the pool holds blocks 0-63
        bad = StepPlan(step_id=5, seqs=[ScheduledSeq(0, [samples[0][0].token_id], 16, table, seq.sample)])
        with pytest.raises(PlanError):
            full.execute(bad)
        with pytest.raises(PlanError):
            kept.execute(bad)
    assert run.tables == [[1]]


def _path(name: str, checkpoint_dir, tmp_path_factory):
    return write_all_kept(tmp_path_factory, seed=41) if name == "gguf-kept" else checkpoint_dir(name)


@pytest.mark.parametrize("name,lengths", [("llama-gqa-untied", (9, 21, 30)), ("qwen2-bias-tied", (13,)),
                                          ("gguf-kept", (11,)), ("gguf-kept", (11, 26))])
@pytest.mark.parametrize("streams", [False, True])
def test_a_decode_runs_steps_straight_through_the_kept_run_are_the_plans_steps(checkpoint_dir, tmp_path_factory,
                                                                                streams, name, lengths):
    """run_steps through ModelRunner.steps_after (no plan per step; whole answers: every later step
    in one native call, kernels/native/decode_run.c) against run_steps by plans on a second runner:
    the same samples, streamed results, last plan and last result; the run ends at the first
    sequence's last block as next_plan ends it, and steps_after gives nothing for a result the kept
    run did not compute. The LM heads: dense bfloat16 (its panels or rows), tied to the embedding,
    and GGUF Q8_0 blocks rounded into bfloat16 logits."""
    straight_through(_path(name, checkpoint_dir, tmp_path_factory), "bfloat16", streams, lengths)


def straight_through(path, dtype: str, streams: bool, lengths: tuple[int, ...]) -> None:
    """The check of test_a_decode_runs_steps_straight_through_the_kept_run_are_the_plans_steps on
    runners in `dtype` (test_decode_run_float32.py: float32)."""
    by_plans, straight = _runner(path, dtype), _runner(path, dtype)
    prompts = make_prompts(seed=4, lengths=lengths)
    tables = [[8 * i + j for j in range(len(prompt) // BLOCK + 2)] for i, prompt in enumerate(prompts)]
    plan = _prefill((by_plans, straight), prompts, tables, SampleSpec())
    plan.num_steps, plan.streams_steps = 40, streams
    room = min(len(table) * BLOCK - len(prompt) for prompt, table in zip(prompts, tables))
    outcomes = []
    for runner, steps_after in ((by_plans, None), (straight, "runner")):
        first = runner.execute(plan)
        sent, executed = [], []

        def try_execute(step, runner=runner):
            executed.append(step.seqs[0].start_position)
            return runner.execute(step)

        with torch.inference_mode():  # as the worker runs a run (worker/process.py)
            outcomes.append((run_steps(first, plan, BLOCK, try_execute, lambda: False, sent.append,
                                       runner.steps_after if steps_after else None), sent, executed))
    (result, last, last_result), sent, executed = outcomes[0]
    (result_through, last_through, last_result_through), sent_through, executed_through = outcomes[1]
    assert len(executed) == room - 1 and not executed_through  # the later steps by plans, or none
    untimed = dataclasses.replace(result_through, forward_seconds=result.forward_seconds)  # the times differ
    assert untimed == result and result.num_steps == room
    assert last_through == last and last.seqs[0].start_position == plan.seqs[0].start_position + room - 1
    assert last_result_through.samples == last_result.samples
    assert [step.samples for step in sent_through] == [step.samples for step in sent]
    assert [step.run_step for step in sent_through] == ([*range(1, room + 1)] if streams else [])
    assert next_plan(last_through, last_result_through, BLOCK) is None  # the block ends there
    assert straight.steps_after(by_plans.execute(last)) is None
    assert straight._decode_run._steps is not None  # the one-call path was there to take


def _run_both(by_plans, straight, plan, poll=None):
    """run_steps of plan (a decode run that does not stream) by plans, and through the kept run in
    one native call, its message check `poll`."""
    outcomes = []
    for runner, through in ((by_plans, False), (straight, True)):
        first = runner.execute(plan)
        steps_after = None
        if through:
            def steps_after(result, runner=runner):
                advance = runner.steps_after(result)
                assert advance.many is not None
                advance.many = partial(advance.many, poll=poll)
                return advance
        with torch.inference_mode():
            outcomes.append(run_steps(first, plan, BLOCK, runner.execute, lambda: False, None, steps_after))
    (result, last, last_result), (result_through, last_through, last_result_through) = outcomes
    assert dataclasses.replace(result_through, forward_seconds=result.forward_seconds) == result
    assert last_through == last and last_result_through.samples == last_result.samples
    return result


def test_a_run_in_one_call_ends_after_a_step_that_sampled_an_end_token(checkpoint_dir):
    """An end token (EOS, a stop token) sampled by any row ends the run after that step, as the
    loop ends it; the step after the run then runs through a plan, from the same state."""
    path = checkpoint_dir("llama-gqa-untied")
    by_plans, straight = _runner(path), _runner(path)
    prompts = make_prompts(seed=7, lengths=(10, 19))
    tables = [[8 * i + j for j in range(4)] for i in range(len(prompts))]
    plan = _prefill((by_plans, straight), prompts, tables, SampleSpec())
    plan.num_steps = 8
    free = _run_both(by_plans, straight, plan)  # no end token: all 8 steps
    assert free.num_steps == 8
    tokens = [sample.token_id for sample in free.samples]
    end = tokens[2 * 2 + 1]  # the second row's sample in the run's third step
    ends_at = tokens.index(end) // 2 + 1  # the steps up to the first that sampled it
    by_plans, straight = _runner(path), _runner(path)
    plan = _prefill((by_plans, straight), prompts, tables, SampleSpec())
    plan.num_steps, plan.end_token_ids = 8, [end]
    ended = _run_both(by_plans, straight, plan)
    assert ended.num_steps == ends_at <= 3 and ended.samples == free.samples[:2 * ends_at]


def test_a_run_in_one_call_computes_nothing_while_a_message_waits(checkpoint_dir):
    """A message waiting on the worker's plan socket (worker/message_poll.py, zmq_poll from C) ends
    the run before its first later step, as the loop's should_end does; without one the run goes on."""
    import zmq

    from pagedserve.worker.message_poll import NativePoll

    path = checkpoint_dir("llama-gqa-untied")
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        sender.bind("inproc://plans")
        receiver.connect("inproc://plans")
        poll = NativePoll.for_socket(receiver)
        assert poll is not None
        prompts = make_prompts(seed=8, lengths=(12,))
        for waiting in (False, True):
            if waiting:
                sender.send(b"end run")
                assert receiver.poll(1000)
            by_plans, straight = _runner(path), _runner(path)
            plan = _prefill((by_plans, straight), prompts, [[1, 2]], SampleSpec())
            plan.num_steps = 6
            first = straight.execute(plan)
            advance = straight.steps_after(first)
            advance.many = partial(advance.many, poll=poll.args)
            result, last, last_result = run_steps(first, plan, BLOCK, straight.execute, lambda: False, None,
                                                  lambda result: advance)
            assert result.num_steps == (1 if waiting else 6)
            if waiting:
                assert result is first and last is plan and last_result is first
        assert receiver.recv() == b"end run"  # the check read nothing
    finally:
        sender.close(0)
        receiver.close(0)
        context.term()
