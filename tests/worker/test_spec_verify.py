"""Speculative verification on the worker: the rejection sampler's output distribution (pure
functions, ~10^6 draws), and ModelRunner steps with drafts against HF greedy tokens and against
seeded sampling without drafts."""

from __future__ import annotations

import pytest
import torch
from tiny_models import MAX_NEW_TOKENS, make_prompts
from plan_driver import DrivenSeq, PlanDriver

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.speculation.rejection_sampler import num_accepted_one_hot, rejection_sample
from pagedserve.worker.sampler import Sampler, restrict_support
from pagedserve.worker.speculation.ngram_verify import row_specs

NAME = "llama-gqa-untied"
VOCAB = 50
NUM_DRAWS = 1_000_000
CHUNK = 250_000


def _target_probs(generator: torch.Generator, spec: SampleSpec, num_positions: int) -> torch.Tensor:
    """[num_positions, VOCAB]: processed target distributions (temperature, top-k, top-p)."""
    logits = torch.randn(num_positions, VOCAB, generator=generator) * 2.0
    return restrict_support(logits, [spec] * num_positions).softmax(dim=-1)


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("is_one_hot", [True, False])
def test_rejection_sampler_emits_the_target_distribution(is_one_hot):
    generator = torch.Generator().manual_seed(7)
    spec = SampleSpec(temperature=0.9, top_k=30, top_p=0.95)
    p = _target_probs(generator, spec, 3)  # [K + 1 = 3, V]
    q = torch.rand(2, VOCAB, generator=generator) ** 3
    q = q / q.sum(dim=-1, keepdim=True)  # [K, V], a draft distribution unlike p
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    fixed_drafts = torch.tensor([int(p[0].argmax()), int(p[1].argmax())])
    num_accepted_total = 0
    for _ in range(NUM_DRAWS // CHUNK):
        if is_one_hot:
            drafts = fixed_drafts.expand(CHUNK, 2).clone()
            draft_probs = None
        else:
            drafts = torch.stack([torch.multinomial(q[i], CHUNK, replacement=True, generator=generator)
                                  for i in range(2)], dim=1)  # [N, K], d_i ~ q_i
            draft_probs = q.expand(CHUNK, 2, VOCAB)
        num_accepted, emitted = rejection_sample(p.expand(CHUNK, 3, VOCAB), drafts, draft_probs, generator)
        assert ((emitted >= 0).sum(dim=1) == num_accepted + 1).all()
        num_accepted_total += int(num_accepted.sum())
        first += torch.bincount(emitted[:, 0], minlength=VOCAB)
        rows = emitted[:, 1] >= 0  # the first draft was accepted
        second += torch.bincount(emitted[rows, 1], minlength=VOCAB)
    assert _tv(first, p[0]) < 0.01
    # once d1 is accepted the next token must follow p_1 (here the same whatever d1 was)
    assert second.sum() > 200_000 and _tv(second, p[1]) < 0.01
    assert num_accepted_total > 0


def test_serving_path_one_hot_verification_emits_the_target_distribution():
    """What spec_verify does for n-gram drafts: every row drawn by the Sampler, accepted while
    the draw equals the draft."""
    generator = torch.Generator().manual_seed(8)
    spec = SampleSpec(temperature=0.8, top_k=20, top_p=0.9)
    logits = torch.randn(2, VOCAB, generator=generator) * 2.0  # rows: after the last token, after d1
    p = restrict_support(logits, [spec] * 2).softmax(dim=-1)
    draft = int(p[0].argmax())
    sampler = Sampler(seed=3)
    num_draws = 200_000  # the sampler's per-row objects are slower than the pure function
    rows = logits[:1].expand(num_draws, VOCAB)
    drawn = [sample.token_id for sample in sampler.sample(rows, [spec] * num_draws, list(range(num_draws)),
                                                          [5] * num_draws)]
    accepted = [num_accepted_one_hot([token], [draft]) for token in drawn]
    assert all(a == (token == draft) for a, token in zip(accepted, drawn))
    assert 0 < sum(accepted) < num_draws
    assert _tv(torch.bincount(torch.tensor(drawn), minlength=VOCAB).float(), p[0]) < 0.01


@pytest.fixture(scope="module")
def runner(checkpoint_dir) -> ModelRunner:
    runner = ModelRunner(checkpoint_dir(NAME), device="cpu", dtype="float32", block_size=16, seed=0)
    runner.load()
    runner.init_cache(64, 4)
    return runner


def _verify(driver: PlanDriver, seq: DrivenSeq, drafts: list[int]) -> list[int]:
    """One step computing seq's last token plus drafts; returns the emitted tokens (not appended)."""
    end = len(seq.tokens) + len(drafts)
    driver.allocate(seq, end)
    driver.step_id += 1
    scheduled = ScheduledSeq(seq.seq_id, seq.tokens[-1:] + drafts, len(seq.tokens) - 1, list(seq.block_table),
                             seq.spec, len(drafts))
    result = driver.runner.execute(StepPlan(step_id=driver.step_id, seqs=[scheduled]))
    assert not result.failures
    return [sample.token_id for sample in result.samples]


def test_drafts_verify_to_the_greedy_tokens_of_hf(runner, hf_greedy):
    prompt = make_prompts(seed=5, lengths=(30,))[0]
    expected = hf_greedy(NAME, prompt)
    driver = PlanDriver(runner, 64)
    seq = DrivenSeq(seq_id=1, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.step([(seq, len(prompt))])  # prefill: first token
    # right, right, wrong: 2 accepted, then the target's token where the third was rejected
    drafts = expected[1:3] + [(expected[3] + 1) % 512]
    emitted = _verify(driver, seq, drafts)
    assert emitted == expected[1:4]
    seq.tokens += emitted
    seq.num_computed = len(seq.tokens) - 1  # rejected slots are simply overwritten later
    emitted = _verify(driver, seq, expected[4:8])  # all four right: plus the bonus token
    assert emitted == expected[4:9]
    seq.tokens += emitted
    seq.num_computed = len(seq.tokens) - 1
    emitted = _verify(driver, seq, [(expected[9] + 7) % 512])  # wrong at once: just the target's token
    assert emitted == expected[9:10]


def test_seeded_sampling_with_penalties_is_the_same_with_drafts(runner):
    prompt = make_prompts(seed=6, lengths=(20,))[0]
    # seeded rows draw the noise of their position, so the tokens must not depend on the step
    # that computes them (test_rows_count_the_drafts... checks the penalty history directly)
    spec = SampleSpec(temperature=0.3, top_k=40, seed=1234, repetition_penalty=1.5, frequency_penalty=3.0,
                      presence_penalty=3.0, prompt_token_ids=prompt)
    plain_driver = PlanDriver(runner, 64)
    plain = DrivenSeq(seq_id=1, prompt=prompt, max_new_tokens=16, spec=spec)
    plain_driver.step([(plain, len(prompt))])
    while not plain.is_finished:  # penalties count every output so far
        plain.spec = SampleSpec(**{**_fields(spec), "output_token_ids": plain.generated})
        plain_driver.step([(plain, 1)])
    expected = plain.generated[:16]

    driver = PlanDriver(runner, 64)
    seq = DrivenSeq(seq_id=2, prompt=prompt, max_new_tokens=16, spec=spec)
    driver.step([(seq, len(prompt))])
    while len(seq.generated) < 16:
        seq.spec = SampleSpec(**{**_fields(spec), "output_token_ids": seq.generated})
        position = len(seq.generated)
        drafts = expected[position:position + 3] + [3]  # three right (while they last), then one wrong
        emitted = _verify(driver, seq, drafts)
        assert 1 <= len(emitted) <= len(drafts) + 1
        seq.tokens += emitted
        seq.num_computed = len(seq.tokens) - 1
    assert seq.generated[:16] == expected


def _fields(spec: SampleSpec) -> dict:
    return {name: getattr(spec, name) for name in SampleSpec.__slots__}


def test_rows_count_the_drafts_before_them_as_outputs_for_penalties():
    penalised = SampleSpec(temperature=0.5, frequency_penalty=1.0, output_token_ids=[7])
    plain = SampleSpec(temperature=0.5)
    rows = row_specs([penalised, penalised, penalised, plain, plain], [[4, 5], [9]])
    assert [row.output_token_ids for row in rows[:3]] == [[7], [7, 4], [7, 4, 5]]
    assert rows[3] is plain and rows[4] is plain  # nothing to count: the spec object is shared
