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

Draft mode (has_draft_model, for plans with drafts_from_worker): a second fake cache beside the
first, same blocks and slots, holds what a draft model computed there, chained the same way (so a
slot's draft value equals its target value exactly when the draft computed it from the same
prefix). Swaps and copies move both caches; a target write voids the slot's draft value unless
the same step's draft forward wrote it (the draft KV is then from an earlier life of the slot). For each drafting sequence the worker first checks
that every position before draft_start_position holds the draft value of the sequence's own
prefix (the scheduler's lazy catch-up bookkeeping, Sequence.num_draft_computed) and raises
DigestWorkerError otherwise; then it writes draft values for draft_context_ids + [t] and for
its proposals d1 .. d(k-1), as a real draft model writes its KV. Its proposals are the target's
own next token three times in four and another allowed token otherwise, decided by a hash of the
draft's value, so acceptance varies deterministically.

LoRA: the plan's lora_loads fill the worker's adapter slots (at most max_loras of them); a
sequence with a lora_slot starts its chain from a root made of that slot's adapter digest, so a
KV block reused across adapters (a stale prefix-cache hit) changes the tokens like any mix-up, and
a sequence whose slot holds no adapter raises DigestWorkerError.

Candidates are ranked best first: by default a seeded shuffle of the vocabulary with random
logprobs in decreasing order; with logit_std, seeded Gaussian logits over the vocabulary (a
peaked, model-like distribution, which the memory benchmark's beam searches need) and their
log-softmax.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, SeqSample, StepPlan, StepResult
from pagedserve.contracts.tier_ops import block_file_name

_ROOT = 0x5EED
_MASK = (1 << 48) - 1
_DRAFT_SALT = 0xD4AF7


class DigestWorkerError(AssertionError):
    """The plan asked the worker for something a real one would get wrong."""


class DigestWorker:
    """Runs a StepPlan on fake KV: block operations first, then writes, then samples.

    Token ids below first_token_id are never sampled (the demo tokenizer's special ids, for
    workloads that must not stop early); `plans` keeps every plan run. has_draft_model: the
    draft mode of the module docstring (for_config turns it on for --speculative-method draft).
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0, *,
                 vocab_size: int = 24, first_token_id: int = 0, logit_std: float | None = None,
                 has_draft_model: bool = False, num_host_blocks: int = 0,
                 disk_folder: str | None = None, max_loras: int = 0) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.first_token_id = first_token_id
        self.logit_std = logit_std
        self.has_draft_model = has_draft_model
        self.gpu: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        num_draft_gpu, num_draft_cpu = (num_gpu_blocks, num_cpu_blocks) if has_draft_model else (0, 0)
        self.draft_gpu: list[list[int | None]] = [[None] * block_size for _ in range(num_draft_gpu)]
        self.draft_cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_draft_cpu)]
        self.plans: list[StepPlan] = []
        # KV tiers (pagedserve.contracts.tier_ops): host slots, and block files (JSON of the slot
        # values) in disk_folder, the layout folder the scheduler indexes; a test may damage them
        self.host: list[list[int | None] | None] = [None] * num_host_blocks
        self.disk_folder = disk_folder
        self.max_loras = max_loras
        self.lora_slots: dict[int, str] = {}  # slot -> adapter digest

    @classmethod
    def for_config(cls, config, **options) -> "DigestWorker":
        """A worker whose pools (and draft mode) match a SchedulerConfig's."""
        options.setdefault("has_draft_model", config.speculative_method == "draft")
        options.setdefault("num_host_blocks", config.num_host_blocks)
        options.setdefault("disk_folder", config.kv_layout_folder)
        options.setdefault("max_loras", config.max_loras if config.enable_lora else 0)
        return cls(config.block_size, config.num_gpu_blocks, config.num_cpu_blocks, **options)

    def run(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        tiers = plan.tier_ops
        if tiers is not None:
            self._save(plan)
        for gpu_blocks, cpu_blocks in ((self.gpu, self.cpu), (self.draft_gpu, self.draft_cpu)):
            if not gpu_blocks:
                continue
            for gpu, cpu in plan.blocks_to_swap_out:
                cpu_blocks[cpu] = list(gpu_blocks[gpu])
        failed_fetch_keys = self._fetch(plan) if tiers is not None else []
        for gpu_blocks, cpu_blocks in ((self.gpu, self.cpu), (self.draft_gpu, self.draft_cpu)):
            if not gpu_blocks:
                continue
            for cpu, gpu in plan.blocks_to_swap_in:
                gpu_blocks[gpu] = list(cpu_blocks[cpu])
        if tiers is not None:
            self._load(plan)
        for gpu_blocks in (self.gpu, self.draft_gpu):
            for src, dst in plan.blocks_to_copy if gpu_blocks else ():
                gpu_blocks[dst] = list(gpu_blocks[src])
        for load in plan.lora_loads:
            if not 0 <= load.slot < self.max_loras:
                raise DigestWorkerError(f"step {plan.step_id} loads an adapter into slot {load.slot} of {self.max_loras}")
            self.lora_slots[load.slot] = load.digest
        for seq in plan.seqs:
            if seq.lora_slot >= 0 and seq.lora_slot not in self.lora_slots:
                raise DigestWorkerError(f"sequence {seq.seq_id} uses LoRA slot {seq.lora_slot}, which holds no adapter")
        seq_ids = [seq.seq_id for seq in plan.seqs]
        if len(set(seq_ids)) != len(seq_ids):
            raise DigestWorkerError(f"step {plan.step_id} schedules a sequence twice")
        draft_written: dict[tuple[int, int], int] = {}
        seqs = self._propose_drafts(plan, draft_written) if plan.drafts_from_worker else plan.seqs
        written: dict[tuple[int, int], int] = {}
        for seq in seqs:
            self._write(seq, written, draft_written)
        samples = []
        for seq in seqs:
            if seq.sample is not None:
                samples += self._verify(seq, written)
        return StepResult(step_id=plan.step_id, samples=samples, epoch=plan.epoch,
                          failed_fetch_keys=failed_fetch_keys)

    # -- KV tiers -----------------------------------------------------------------------------
    def _save(self, plan: StepPlan) -> None:
        """Saves read full device blocks (every slot written); deletes follow them."""
        for save in plan.tier_ops.saves:
            block = self.gpu[save.block_id]
            if any(value is None for value in block):
                raise DigestWorkerError(f"step {plan.step_id} saves device block {save.block_id}, "
                                        f"which is not full: {block}")
            if save.host_slot >= 0:
                self.host[save.host_slot] = list(block)
            if save.to_disk and self.disk_folder is not None:
                os.makedirs(self.disk_folder, exist_ok=True)
                path = self._path(save.key)
                with open(path + ".tmp", "w") as file:
                    json.dump(block, file)
                os.replace(path + ".tmp", path)
        for key in plan.tier_ops.deletes:
            if os.path.exists(self._path(key)):
                os.remove(self._path(key))

    def _path(self, key: bytes) -> str:
        return os.path.join(self.disk_folder or "", block_file_name(key, 0))

    def _fetch(self, plan: StepPlan) -> list[bytes]:
        failed = []
        for key, slot in plan.tier_ops.fetches:
            try:
                with open(self._path(key)) as file:
                    content = json.load(file)
                if not isinstance(content, list) or len(content) != self.block_size:
                    raise ValueError("truncated")
                self.host[slot] = content
            except (OSError, ValueError):
                if os.path.exists(self._path(key)):
                    os.remove(self._path(key))  # a damaged file is removed, as the real worker does
                self.host[slot] = None
                failed.append(key)
        return failed

    def _load(self, plan: StepPlan) -> None:
        for slot, block in plan.tier_ops.loads:
            content = self.host[slot]
            if content is None:
                raise DigestWorkerError(f"step {plan.step_id} loads host slot {slot}, which holds nothing")
            self.gpu[block] = list(content)
            if self.draft_gpu:
                self.draft_gpu[block] = [None] * self.block_size  # the tiers keep the target's KV only

    # -- draft mode ---------------------------------------------------------------------------
    def _propose_drafts(self, plan: StepPlan, draft_written: dict[tuple[int, int], int]) -> list[ScheduledSeq]:
        """The plan's sequences with every drafting one's placeholders replaced by proposals;
        draft_written collects the slots whose draft KV this step wrote."""
        if not self.has_draft_model:
            raise DigestWorkerError(f"step {plan.step_id} asks for draft-model proposals; there is no draft model")
        seqs = []
        for seq in plan.seqs:
            if seq.num_draft_tokens:
                seq = self._propose(seq, draft_written)
            elif seq.draft_context_ids:
                raise DigestWorkerError(f"sequence {seq.seq_id} has draft context but no drafts")
            seqs.append(seq)
        return seqs

    def _propose(self, seq: ScheduledSeq, draft_written: dict[tuple[int, int], int]) -> ScheduledSeq:
        """Checks the draft KV before draft_start_position, runs the draft over the draft context
        and t, then proposes d1..dk (writing draft KV for d1..d(k-1)); returns seq with them."""
        num_drafts = seq.num_draft_tokens
        position = seq.start_position  # of t, the last real token
        start = seq.draft_start_position
        if seq.sample is None or seq.token_ids[1:] != [0] * num_drafts or len(seq.token_ids) != num_drafts + 1:
            raise DigestWorkerError(f"sequence {seq.seq_id}: a drafting sequence sends its last token, then "
                                    f"{num_drafts} placeholders, and samples; got {seq.token_ids}")
        if start + len(seq.draft_context_ids) != position:
            raise DigestWorkerError(f"sequence {seq.seq_id}: draft context {start}..{start + len(seq.draft_context_ids)} "
                                    f"does not end at its last token's position {position}")
        for earlier in range(start):
            block, slot = self._slot(seq, earlier)
            if self.draft_gpu[block][slot] is None or self.draft_gpu[block][slot] != self.gpu[block][slot]:
                raise DigestWorkerError(f"sequence {seq.seq_id}: position {earlier} (block {block} slot {slot}) "
                                        f"lacks the draft KV of its tokens, but draft_start_position is {start}")
        value = _ROOT
        if start:
            block, slot = self._slot(seq, start - 1)
            value = self.draft_gpu[block][slot]
        for offset, token_id in enumerate([*seq.draft_context_ids, seq.token_ids[0]]):
            value = hash((value, token_id)) & _MASK
            self._write_draft(seq, start + offset, value, draft_written)
        context = [self._read(seq, earlier, {}) for earlier in range(position)]
        context.append(hash((context[-1] if context else _ROOT, seq.token_ids[0])) & _MASK)
        allowed = self._allowed(seq.sample)
        drafts = []
        for index in range(num_drafts):
            best = self._rank(seq.sample, tuple(context))[0][0]  # what the target will sample here
            rng = random.Random(hash((value, _DRAFT_SALT)))
            others = [token for token in allowed if token != best]
            token_id = rng.choice(others) if others and rng.randrange(4) == 0 else best
            drafts.append(token_id)
            context.append(hash((context[-1], token_id)) & _MASK)
            if index < num_drafts - 1:  # the draft model never computes its last proposal
                value = hash((value, token_id)) & _MASK
                self._write_draft(seq, position + 1 + index, value, draft_written)
        return dataclasses.replace(seq, token_ids=[seq.token_ids[0], *drafts])

    def _write_draft(self, seq: ScheduledSeq, position: int, value: int,
                     draft_written: dict[tuple[int, int], int]) -> None:
        """Sequences sharing a block may rewrite its draft KV in one step, with the same values."""
        block, slot = self._slot(seq, position)
        if draft_written.setdefault((block, slot), value) != value:
            raise DigestWorkerError(f"sequence {seq.seq_id} writes other draft KV into block {block} slot {slot} "
                                    f"than another sequence in the same step")
        self.draft_gpu[block][slot] = value

    def _slot(self, seq: ScheduledSeq, position: int) -> tuple[int, int]:
        block_index = position // self.block_size
        if block_index >= len(seq.block_table):
            raise DigestWorkerError(f"sequence {seq.seq_id}: position {position} outside its block table")
        return seq.block_table[block_index], position % self.block_size

    def _write(self, seq: ScheduledSeq, written: dict[tuple[int, int], int],
               draft_written: dict[tuple[int, int], int]) -> None:
        """Target KV of seq's new tokens. A slot's draft KV from before (an earlier user of the
        block, or the sequence before it was recomputed) is void now, unless this step's draft
        forward wrote it."""
        if len(seq.block_table) - -(-seq.context_len // self.block_size) not in (0, 1):  # 1: a block ahead
            raise DigestWorkerError(f"sequence {seq.seq_id}: {len(seq.block_table)} blocks for "
                                    f"{seq.context_len} tokens")
        value = self._root(seq) if seq.start_position == 0 else self._read(seq, seq.start_position - 1, written)
        for offset, token_id in enumerate(seq.token_ids):
            block, slot = self._slot(seq, seq.start_position + offset)
            if (block, slot) in written:
                raise DigestWorkerError(f"block {block} slot {slot} written twice in step")
            value = hash((value, token_id)) & _MASK
            self.gpu[block][slot] = value
            if self.draft_gpu and (block, slot) not in draft_written:
                self.draft_gpu[block][slot] = None
            written[(block, slot)] = seq.seq_id

    def _root(self, seq: ScheduledSeq) -> int:
        if seq.lora_slot < 0:
            return _ROOT
        return hash((_ROOT, self.lora_slots[seq.lora_slot])) & _MASK

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
            sample = self._sample(seq, written, seq.context_len - num_drafts + index, row=index)
            samples.append(sample)
            if index == num_drafts or sample.token_id != seq.token_ids[first_draft + index]:
                break
        return samples

    def _sample(self, seq: ScheduledSeq, written: dict[tuple[int, int], int], context_len: int,
                row: int = 0) -> SeqSample:
        context = tuple(self._read(seq, position, written) for position in range(context_len))
        spec = seq.sample
        ranked, logprobs = self._rank(spec, context)
        if seq.num_mask_rows:  # structured output: the best tokens the row's bitmask allows
            if seq.num_mask_rows != seq.num_draft_tokens + 1:
                raise DigestWorkerError(f"sequence {seq.seq_id}: {seq.num_mask_rows} mask rows for "
                                        f"{seq.num_draft_tokens + 1} sampled rows")
            row_bytes = len(seq.token_bitmask) // seq.num_mask_rows
            mask = seq.token_bitmask[row * row_bytes:(row + 1) * row_bytes]
            kept = [i for i, token in enumerate(ranked) if mask[token // 8] >> (token % 8) & 1]
            if not kept:
                raise DigestWorkerError(f"sequence {seq.seq_id}: the mask allows none of the tokens")
            ranked, logprobs = [ranked[i] for i in kept], [logprobs[i] for i in kept]
        sample = SeqSample(seq_id=seq.seq_id, token_id=ranked[0], logprob=logprobs[0])
        if spec.num_logprobs:
            sample.top_token_ids = ranked[:spec.num_logprobs]
            sample.top_logprobs = logprobs[:spec.num_logprobs]
        if spec.num_beam_candidates:
            sample.beam_token_ids = ranked[:spec.num_beam_candidates]
            sample.beam_logprobs = logprobs[:spec.num_beam_candidates]
        return sample

    def _allowed(self, spec: SampleSpec) -> list[int]:
        return [token for token in range(self.first_token_id, self.vocab_size) if token not in spec.suppress_token_ids]

    def _rank(self, spec: SampleSpec, context: tuple[int, ...]) -> tuple[list[int], list[float]]:
        """Candidates best first and their logprobs, from the KV values of the context."""
        seed = -1 if spec.seed is None else spec.seed  # hash(None) differs between processes
        rng = random.Random(hash((context, spec.output_index, seed)))
        allowed = self._allowed(spec)
        if self.logit_std is None:
            logprobs = sorted((-rng.randrange(1, 4000) / 64.0 for _ in allowed), reverse=True)
            ranked = rng.sample(allowed, len(allowed))
        else:
            logits = {token: rng.gauss(0.0, self.logit_std) for token in allowed}
            peak = max(logits.values())
            log_total = peak + math.log(sum(math.exp(logit - peak) for logit in logits.values()))
            ranked = sorted(allowed, key=lambda token: -logits[token])
            logprobs = [logits[token] - log_total for token in ranked]
        return ranked, logprobs
