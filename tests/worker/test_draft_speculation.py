"""Draft-model speculation in the worker, driven by plans that keep the design's draft-KV
bookkeeping (draft_driver.py): greedy tokens equal HF's greedy generate on the target, whatever the
draft; seeded sampling is reproducible and independent of the batch; the emitted distribution of
sampled rows is the target's; the draft's KV survives swaps, copies and cached prefixes.

Two kinds of draft: a 1-layer toy checkpoint with the target's vocabulary (a poor draft: mostly
rejections) and the target itself (with quantization none every draft is accepted exactly when
the draft KV the design's bookkeeping promises is really in the cache, which makes it a probe of
the draft KV; with int4 the cheap self-draft of the issue).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tiny_models import MAX_NEW_TOKENS, PROMPT_LENGTHS, SIZES, make_prompts
from draft_driver import DraftDriver, DraftedSeq

from pagedserve.kernels.linear.packed_weights import Int4Weight
from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, StepPlan
from pagedserve.worker.speculation.draft_model import DraftModelError
from pagedserve.worker.model_input import PlanError
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.sampler import processed_logits, sampling_probs

NAME = "llama-gqa-untied"
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """The target's first layer, embeddings and head alone (the same seed draws them first)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("draft-1-layer"), **{**SIZES, "num_layers": 1},
                                 architecture="llama", seed=11)


def _runner(target, draft, quantization: str = "none", num_cpu_blocks: int = 8, **options) -> ModelRunner:
    runner = ModelRunner(target, device="cpu", dtype="float32", block_size=16, speculative_model=draft,
                         speculative_quantization=quantization, **options)
    runner.load()
    runner.init_cache(NUM_BLOCKS, num_cpu_blocks)
    return runner


def _seqs(prompts: list[list[int]], spec: SampleSpec | None = None, max_new_tokens: int = MAX_NEW_TOKENS):
    return [DraftedSeq(seq_id=i, prompt=prompt, max_new_tokens=max_new_tokens, spec=spec or SampleSpec())
            for i, prompt in enumerate(prompts)]


@pytest.mark.parametrize("num_drafts", [1, 2, 3, 4])
def test_greedy_tokens_with_a_small_draft_are_hf_greedy_with_prefill_chunks_in_the_same_steps(
        checkpoint_dir, small_draft, hf_greedy, num_drafts):
    runner = _runner(checkpoint_dir(NAME), small_draft)
    prompts = make_prompts(seed=num_drafts, lengths=PROMPT_LENGTHS[:6])
    seqs = _seqs(prompts)
    driver = DraftDriver(runner, NUM_BLOCKS)
    driver.run_to_completion(seqs, token_budget=48, num_drafts=num_drafts)
    for seq, prompt in zip(seqs, prompts):
        assert seq.generated[:MAX_NEW_TOKENS] == hf_greedy(NAME, prompt), f"prompt length {len(prompt)}"
    mixed = [plan for plan in driver.plans
             if any(s.num_draft_tokens for s in plan.seqs) and any(s.sample is None for s in plan.seqs)]
    assert mixed, "no step drafted beside a prefill chunk"
    assert sum(seq.num_drafted for seq in seqs) > sum(seq.num_accepted for seq in seqs) > 0


def test_int4_self_draft_with_a_k_per_sequence_gives_hf_greedy(checkpoint_dir, hf_greedy):
    target = checkpoint_dir(NAME)
    runner = _runner(target, target, quantization="int4")
    prompts = make_prompts(seed=9, lengths=(3, 20, 45, 70, 12))
    seqs = _seqs(prompts)
    driver = DraftDriver(runner, NUM_BLOCKS)
    driver.run_to_completion(seqs, token_budget=40, num_drafts={0: 1, 1: 2, 2: 3, 3: 4})  # seq 4 never drafts
    for seq, prompt in zip(seqs, prompts):
        assert seq.generated[:MAX_NEW_TOKENS] == hf_greedy(NAME, prompt), f"prompt length {len(prompt)}"
    assert seqs[4].num_drafted == 0 and sum(seq.num_accepted for seq in seqs) > 0
    assert isinstance(runner.draft.model.layers[0].mlp.down_proj.packed, Int4Weight)  # quantized for real
    assert runner.model.layers[0].mlp.down_proj.packed is None


def test_exact_self_draft_accepts_every_draft_across_a_cached_prefix_and_a_fork(checkpoint_dir, hf_greedy):
    """The draft KV that num_draft_computed promises is in the cache: a draft context from 0 over
    prefix-cached target blocks (the draft writes the shared blocks again), and the copy-on-write
    of a fork, which copies the draft's part of the block too."""
    target = checkpoint_dir(NAME)
    runner = _runner(target, target)
    driver = DraftDriver(runner, NUM_BLOCKS)
    prompt = make_prompts(seed=11, lengths=(37,))[0]  # 2 full blocks, then 5 tokens
    first = DraftedSeq(seq_id=1, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
    driver.step([(first, len(prompt))])  # no draft KV anywhere yet
    second = DraftedSeq(seq_id=2, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
    second.block_table = first.block_table[:2]  # a prefix-cache hit on the 2 full blocks
    second.num_computed = 32
    driver.step([(second, len(prompt) - 32), (first, 1)], drafts={1: 3})
    assert driver.plans[-1].seqs[1].draft_context_ids == prompt
    driver.step([(first, 1), (second, 1)], drafts={1: 2, 2: 4})
    assert driver.plans[-1].seqs[1].draft_start_position == 0
    assert driver.plans[-1].seqs[1].draft_context_ids == prompt
    child = DraftedSeq(seq_id=3, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)  # n > 1: a fork of second
    child.tokens, child.num_computed = list(second.tokens), second.num_computed
    child.num_draft_computed = second.num_draft_computed
    last = len(second.block_table) - 1
    assert second.num_draft_computed > last * 16  # the copied block holds draft KV the child relies on
    child.block_table = second.block_table[:last] + [driver.free_blocks.pop()]
    driver.step([(second, 1), (child, 1)], drafts={2: 2, 3: 3},
                copy=[(second.block_table[last], child.block_table[last])])
    assert driver.plans[-1].seqs[1].draft_start_position > last * 16
    driver.run_to_completion([first, second, child], num_drafts=3)
    expected = hf_greedy(NAME, prompt)
    for seq in (first, second, child):
        assert seq.generated[:MAX_NEW_TOKENS] == expected
        assert seq.num_accepted == seq.num_drafted > 0, f"seq {seq.seq_id}"


def test_exact_self_draft_accepts_every_draft_after_swap_and_recompute_preemption(checkpoint_dir, hf_greedy):
    """Swapped out and back into other blocks, a sequence's draft KV comes back with its target KV
    (num_draft_computed kept); preempted by recompute it starts from 0 again (the design's reset)."""
    target = checkpoint_dir(NAME)
    runner = _runner(target, target, num_cpu_blocks=16)
    driver = DraftDriver(runner, NUM_BLOCKS)
    swapped, recomputed, other = _seqs(make_prompts(seed=14, lengths=(40, 23, 60)))
    driver.step([(swapped, 40), (recomputed, 23)])
    driver.step([(swapped, 1), (recomputed, 1), (other, 30)], drafts={0: 3, 1: 2})
    device_blocks = list(swapped.block_table)
    host_blocks = list(range(len(device_blocks)))
    driver.free(swapped)
    driver.free(recomputed)
    recomputed.num_computed, recomputed.num_draft_computed = 0, 0
    driver.step([(other, 30)], swap_out=list(zip(device_blocks, host_blocks)))
    swapped.block_table = [driver.free_blocks.pop() for _ in host_blocks][::-1]
    assert swapped.block_table != device_blocks
    driver.step([(swapped, 1), (other, 1), (recomputed, recomputed.num_pending)], drafts={0: 4, 2: 2},
                swap_in=list(zip(host_blocks, swapped.block_table)))
    assert driver.plans[-1].seqs[0].draft_start_position > 40  # the swapped draft KV is relied on
    driver.run_to_completion([swapped, recomputed, other], num_drafts=3)
    for seq, length in zip((swapped, recomputed, other), (40, 23, 60)):
        assert seq.generated[:MAX_NEW_TOKENS] == hf_greedy(NAME, seq.prompt), f"prompt length {length}"
        assert seq.num_accepted == seq.num_drafted > 0, f"seq {seq.seq_id}"


def test_long_draft_contexts_are_split_into_bounded_draft_forwards(checkpoint_dir, hf_greedy):
    target = checkpoint_dir(NAME)
    runner = _runner(target, target)
    runner.draft_proposer.max_tokens_per_forward = 7
    num_tokens = []
    forward = runner.draft.logits
    runner.draft.logits = lambda token_ids, *rest: (num_tokens.append(len(token_ids)), forward(token_ids, *rest))[1]
    prompts = make_prompts(seed=15, lengths=(30, 9, 2))
    seqs = _seqs(prompts)
    DraftDriver(runner, NUM_BLOCKS).run_to_completion(seqs, num_drafts=2)
    # the first drafting step: contexts of 30 + 9 + 2 tokens and 3 last tokens in 7 forwards, then d1 of all 3
    assert num_tokens[:8] == [7, 7, 7, 7, 7, 7, 2, 3]
    assert max(num_tokens) == 7
    for seq, prompt in zip(seqs, prompts):
        assert seq.generated[:MAX_NEW_TOKENS] == hf_greedy(NAME, prompt)
        assert seq.num_accepted == seq.num_drafted > 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafts_are_processed_like_the_target_rows_penalties_and_suppression_included(checkpoint_dir, temperature):
    """With the exact self-draft, q equals p only when each draft row is processed as the target's
    row at that position (penalties counting the earlier drafts as outputs, suppressed ids,
    temperature, top-k/p, min-p): then every draft is accepted (u q < p for u < 1), and the tokens
    are those of decoding without speculation (seeded: the same draws are not promised, greedy: they are)."""
    target = checkpoint_dir(NAME)
    runner = _runner(target, target)
    prompts = make_prompts(seed=16, lengths=(12, 40))
    spec = SampleSpec(temperature=temperature, top_k=30, top_p=0.9, min_p=0.02, seed=5, repetition_penalty=1.4,
                      presence_penalty=0.5, frequency_penalty=0.7, suppress_token_ids=[7, 8, 9])
    plain = _seqs(prompts, spec=spec, max_new_tokens=16)
    DraftDriver(runner, NUM_BLOCKS).run_to_completion(plain)
    drafted = _seqs(prompts, spec=spec, max_new_tokens=16)
    driver = DraftDriver(runner, NUM_BLOCKS)
    driver.run_to_completion(drafted, num_drafts=3)
    for seq in drafted:
        assert seq.num_accepted == seq.num_drafted > 0
        assert not {7, 8, 9} & set(seq.generated)
    if temperature == 0.0:
        assert [seq.generated[:16] for seq in drafted] == [seq.generated for seq in plain]
    penalised = [s for plan in driver.plans for s in plan.seqs if s.num_draft_tokens and s.sample.output_token_ids]
    assert penalised  # the penalty history was really sent


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(checkpoint_dir, small_draft):
    target = checkpoint_dir(NAME)
    prompt = make_prompts(seed=12, lengths=(25,))[0]
    spec = SampleSpec(temperature=0.9, top_k=40, top_p=0.95, seed=77, num_logprobs=2)
    runs = []
    for others in (0, 3):
        runner = _runner(target, small_draft, seed=others)  # the unseeded rows' generator differs too
        seqs = _seqs([prompt] + make_prompts(seed=13, lengths=(9, 30, 50))[:others], spec=SampleSpec(temperature=1.0),
                     max_new_tokens=16)
        seqs[0].spec = spec
        driver = DraftDriver(runner, NUM_BLOCKS)
        driver.run_to_completion(seqs, num_drafts=3)
        samples = [sample for result in driver.results for sample in result.samples if sample.seq_id == 0]
        assert all(len(sample.top_token_ids) == 2 and sample.logprob <= 0.0 for sample in samples)
        runs.append((seqs[0].generated, seqs[0].num_accepted))
    assert runs[0] == runs[1]
    assert 0 < runs[0][1]  # some drafts were accepted, so the rejection sampler's accept path ran


def test_emitted_tokens_of_sampled_rows_follow_the_target_distribution(tmp_path_factory):
    """Many copies of one prompt, each drafting 2 tokens from a draft unlike the target: the first
    emitted token must follow p(. | prompt), the second (when d1 was accepted) p(. | prompt, d1),
    not the draft's q."""
    from transformers import AutoModelForCausalLM

    sizes = dict(vocab_size=24, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                 max_position_embeddings=64)
    target = build_tiny_checkpoint(tmp_path_factory.mktemp("small-vocab"), **sizes, seed=41)
    draft = build_tiny_checkpoint(tmp_path_factory.mktemp("small-vocab-draft"), **{**sizes, "num_layers": 1}, seed=42)
    spec = SampleSpec(temperature=2.5, top_p=0.98)
    num_copies = 8000
    runner = ModelRunner(target, device="cpu", dtype="float32", block_size=16, seed=5, speculative_model=draft)
    runner.load()
    runner.init_cache(num_copies, 0)
    prompt = [5, 17, 9, 3]
    seqs = _seqs([prompt] * num_copies, spec=spec)
    driver = DraftDriver(runner, num_copies)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny per-sequence attention calls: threads only add overhead
    try:
        driver.step([(seq, len(prompt) - 1) for seq in seqs])  # the prompt's last token t is left to draft from
        driver.step([(seq, 1) for seq in seqs], drafts={seq.seq_id: 2 for seq in seqs})
    finally:
        torch.set_num_threads(num_threads)
    emitted = [seq.tokens[len(prompt):] for seq in seqs]

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()

    def probs(model, tokens: list[int]) -> torch.Tensor:  # [V]
        with torch.no_grad():
            raw = model(torch.tensor([tokens])).logits[0, -1:].float()
        return sampling_probs(processed_logits(raw, [spec]), [spec])[0]

    def tv(tokens: list[int], p: torch.Tensor) -> float:
        counts = torch.bincount(torch.tensor(tokens), minlength=p.shape[0]).float()
        return 0.5 * (counts / counts.sum() - p).abs().sum().item()

    p1, q1 = probs(hf, prompt), probs(hf_draft, prompt)
    assert 0.5 * (p1 - q1).abs().sum() > 0.3  # the draft is far from the target
    first = [tokens[0] for tokens in emitted]
    assert tv(first, p1) < 0.04 and tv(first, q1) > 0.2
    # the most frequent first token as an accepted d1: the next token follows the target given it
    accepted = [tokens for tokens in emitted if len(tokens) >= 2]
    top = max(set(t[0] for t in accepted), key=[t[0] for t in accepted].count)
    second = [tokens[1] for tokens in accepted if tokens[0] == top]
    p2, q2 = probs(hf, prompt + [top]), probs(hf_draft, prompt + [top])
    print(f"TV: first vs p {tv(first, p1):.3f}, vs q {tv(first, q1):.3f}; second ({len(second)} draws) vs p "
          f"{tv(second, p2):.3f}, vs q {tv(second, q2):.3f}; accepted d1 in {len(accepted)} of {num_copies}")
    assert len(second) > 600
    assert tv(second, p2) < 0.1 and tv(second, q2) > 0.2
    assert 0 < len(accepted) < num_copies


def test_a_plan_asking_for_worker_drafts_needs_a_draft_model(checkpoint_dir):
    runner = ModelRunner(checkpoint_dir(NAME), device="cpu", dtype="float32", block_size=16)
    runner.load()
    runner.init_cache(8, 0)
    plan = StepPlan(step_id=1, drafts_from_worker=True, seqs=[
        ScheduledSeq(1, [5, 0, 0], 4, [0], sample=SampleSpec(), num_draft_tokens=2,
                     draft_context_ids=[1, 2, 3, 4], draft_start_position=0)])
    with pytest.raises(PlanError, match="draft model"):
        runner.execute(plan)


def test_a_draft_context_that_does_not_end_before_the_last_token_is_a_plan_error(checkpoint_dir, small_draft):
    runner = _runner(checkpoint_dir(NAME), small_draft)
    plan = StepPlan(step_id=1, drafts_from_worker=True, seqs=[
        ScheduledSeq(1, [5, 0, 0], 4, [0], sample=SampleSpec(), num_draft_tokens=2,
                     draft_context_ids=[1, 2, 3], draft_start_position=0)])
    with pytest.raises(PlanError, match="draft context"):
        runner.execute(plan)


def test_a_draft_with_another_vocabulary_is_a_configuration_error(checkpoint_dir, tmp_path):
    other = build_tiny_checkpoint(tmp_path / "other-vocab", **{**SIZES, "vocab_size": 500}, seed=3)
    runner = ModelRunner(checkpoint_dir(NAME), device="cpu", dtype="float32", block_size=16, speculative_model=other)
    with pytest.raises(DraftModelError, match="vocabulary has 500 tokens, the target model's 512"):
        runner.load()
    worker = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "worker", "--model", str(checkpoint_dir(NAME)), "--device", "cpu",
         "--speculative-model", str(other), "--allow-insecure-internal-transport"],
        capture_output=True, text=True, timeout=120)
    assert worker.returncode == 2
    assert "Traceback" not in worker.stderr  # the configuration error path: one line, after the log lines
    assert worker.stderr.strip().splitlines()[-1].startswith("pagedserve worker: --speculative-model ")
    assert "vocabulary has 500 tokens" in worker.stderr.strip().splitlines()[-1]
