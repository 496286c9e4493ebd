"""A worker stand-in without torch that simulates the KV cache slot by slot and checks every plan.

Scheduler tests and the memory benchmark run the real Scheduler against it, no processes.

The fake KV value of a slot chains the value before it with the token written there, so a slot
holds a digest of the whole prefix up to it. A sampled token is a function of every KV value of
the sequence's context (read through its block table), its output index and its seed. Any block
mix-up (missing copy-on-write, wrong swap mapping, reuse of a live block, a stale prefix-cache
hit) changes the context values and therefore the tokens, so a run under memory pressure must
give exactly the tokens of a run with a huge pool. Plans a real worker would get wrong (a
sequence scheduled twice, a slot written twice in a step, a read of an unwritten slot or of a
slot another sequence writes in the same step, a block table of the wrong length) raise
DigestWorkerError. A sequence with speculative drafts is verified greedily: its emitted tokens are
exactly those it would have sampled one step at a time.

Candidates are ranked best first: by default a seeded shuffle of the vocabulary with random
logprobs in decreasing order; with logit_std, seeded Gaussian logits over the vocabulary (a
peaked, model-like distribution, which the memory benchmark's beam searches need) and their
log-softmax.
"""

from __future__ import annotations

import math
import random

from pagedserve.step_plan import ScheduledSeq, SeqSample, StepPlan, StepResult

_ROOT = 0x5EED
_MASK = (1 << 48) - 1


class DigestWorkerError(AssertionError):
    """The plan asked the worker for something a real one would get wrong."""


class DigestWorker:
    """Runs a StepPlan on fake KV: block operations first, then writes, then samples.

    Token ids below first_token_id are never sampled (the demo tokenizer's special ids, for
    workloads that must not stop early); `plans` keeps every plan run.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0, *,
                 vocab_size: int = 24, first_token_id: int = 0, logit_std: float | None = None) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.first_token_id = first_token_id
        self.logit_std = logit_std
        self.gpu: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.plans: list[StepPlan] = []

    @classmethod
    def for_config(cls, config, **options) -> "DigestWorker":
        """A worker whose pools match a SchedulerConfig's."""
        return cls(config.block_size, config.num_gpu_blocks, config.num_cpu_blocks, **options)

    def run(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for gpu, cpu in plan.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[gpu])
        for cpu, gpu in plan.blocks_to_swap_in:
            self.gpu[gpu] = list(self.cpu[cpu])
        for src, dst in plan.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        seq_ids = [seq.seq_id for seq in plan.seqs]
        if len(set(seq_ids)) != len(seq_ids):
            raise DigestWorkerError(f"step {plan.step_id} schedules a sequence twice")
        written: dict[tuple[int, int], int] = {}
        for seq in plan.seqs:
            self._write(seq, written)
        samples = []
        for seq in plan.seqs:
            if seq.sample is not None:
                samples += self._verify(seq, written)
        return StepResult(step_id=plan.step_id, samples=samples, epoch=plan.epoch)

    def _slot(self, seq: ScheduledSeq, position: int) -> tuple[int, int]:
        block_index = position // self.block_size
        if block_index >= len(seq.block_table):
            raise DigestWorkerError(f"sequence {seq.seq_id}: position {position} outside its block table")
        return seq.block_table[block_index], position % self.block_size

    def _write(self, seq: ScheduledSeq, written: dict[tuple[int, int], int]) -> None:
        if len(seq.block_table) != -(-seq.context_len // self.block_size):
            raise DigestWorkerError(f"sequence {seq.seq_id}: {len(seq.block_table)} blocks for "
                                    f"{seq.context_len} tokens")
        value = _ROOT if seq.start_position == 0 else self._read(seq, seq.start_position - 1, written)
        for offset, token_id in enumerate(seq.token_ids):
            block, slot = self._slot(seq, seq.start_position + offset)
            if (block, slot) in written:
                raise DigestWorkerError(f"block {block} slot {slot} written twice in step")
            value = hash((value, token_id)) & _MASK
            self.gpu[block][slot] = value
            written[(block, slot)] = seq.seq_id

    def _read(self, seq: ScheduledSeq, position: int, written: dict[tuple[int, int], int]) -> int:
        block, slot = self._slot(seq, position)
        if written.get((block, slot), seq.seq_id) != seq.seq_id:
            raise DigestWorkerError(f"sequence {seq.seq_id} reads block {block} slot {slot} that another "
                                    f"sequence writes in the same step")
        value = self.gpu[block][slot]
        if value is None:
            raise DigestWorkerError(f"sequence {seq.seq_id} reads unwritten block {block} slot {slot}")
        return value

    def _verify(self, seq: ScheduledSeq, written: dict[tuple[int, int], int]) -> list[SeqSample]:
        """One sample, or for k drafts the greedy verification: a sample after the last real token
        and after each accepted draft, up to the first that differs from the next draft."""
        num_drafts = seq.num_draft_tokens
        first_draft = len(seq.token_ids) - num_drafts
        samples = []
        for index in range(num_drafts + 1):
            sample = self._sample(seq, written, seq.context_len - num_drafts + index)
            samples.append(sample)
            if index == num_drafts or sample.token_id != seq.token_ids[first_draft + index]:
                break
        return samples

    def _sample(self, seq: ScheduledSeq, written: dict[tuple[int, int], int], context_len: int) -> SeqSample:
        context = tuple(self._read(seq, position, written) for position in range(context_len))
        spec = seq.sample
        seed = -1 if spec.seed is None else spec.seed  # hash(None) differs between processes
        rng = random.Random(hash((context, spec.output_index, seed)))
        allowed = [token for token in range(self.first_token_id, self.vocab_size)
                   if token not in spec.suppress_token_ids]
        if self.logit_std is None:
            logprobs = sorted((-rng.randrange(1, 4000) / 64.0 for _ in allowed), reverse=True)
            ranked = rng.sample(allowed, len(allowed))
        else:
            logits = {token: rng.gauss(0.0, self.logit_std) for token in allowed}
            peak = max(logits.values())
            log_total = peak + math.log(sum(math.exp(logit - peak) for logit in logits.values()))
            ranked = sorted(allowed, key=lambda token: -logits[token])
            logprobs = [logits[token] - log_total for token in ranked]
        sample = SeqSample(seq_id=seq.seq_id, token_id=ranked[0], logprob=logprobs[0])
        if spec.num_logprobs:
            sample.top_token_ids = ranked[:spec.num_logprobs]
            sample.top_logprobs = logprobs[:spec.num_logprobs]
        if spec.num_beam_candidates:
            sample.beam_token_ids = ranked[:spec.num_beam_candidates]
            sample.beam_logprobs = logprobs[:spec.num_beam_candidates]
        return sample
