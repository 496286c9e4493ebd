"""Draft-model speculation, proposing: fills a step's placeholder drafts with the draft model's
proposals (StepPlan.drafts_from_worker).

A drafting sequence (num_draft_tokens = K > 0, a sampling sequence) arrives as

    token_ids            [ ... t, 0, 0, ..., 0 ]      t: its last real token, at position P
                                    └─ K placeholders ─┘
    draft_context_ids    the tokens at draft_start_position .. P - 1 whose draft KV is missing

and is drafted in K draft forwards over the drafting sequences only (each a batch of its own):

    forward 1      draft_context_ids + [t]  at draft_start_position .. P   -> row of t  -> d1 ~ q1
    forward j      [d(j-1)]                 at P + j - 1                   -> d(j)      ~ q(j)   (j = 2..K)

writing the draft's KV into the slots of the sequence's own block table (the same slots the target
writes for those positions); a sequence leaves the loop after its own K. Forward 1 is split into
several when the draft contexts together exceed max_tokens_per_forward. Each draft is picked as the
target would pick a token at that position: the row's spec with the earlier drafts counted as
outputs (penalties), suppressed ids, then greedy argmax, or, for a random row, a draw from
q = sampling_probs (temperature, top-k, top-p, min-p), kept for the rejection sampler. A seeded
row draws from the generator of (seed, output index, position of the draft) salted with
DRAFT_SALT, so its drafts depend on nothing else in the batch; unseeded rows use the sampler's
generator.

Tensor parallelism: every rank runs its shard of each draft forward; rank 0 alone has logits and
picks the drafts, then broadcasts them (one int64 tensor per forward) so every rank feeds the same
tokens to the next draft forward and to the target.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq
from pagedserve.worker.cache_engine import CacheEngine
from pagedserve.worker.speculation.draft_model import DraftModel
from pagedserve.worker.model_input import PlanError, build_model_input
from pagedserve.worker.sampler import (
    Sampler,
    SamplerError,
    processed_logits,
    sampling_probs,
    seeded_generator,
    validate_spec,
)
from pagedserve.worker.speculation.ngram_verify import after_drafts
from pagedserve.worker.layers.tensor_parallel import TensorParallelGroup

DRAFT_SALT = 0x6472616674  # "draft": the seeded draft draws' own stream
DEFAULT_MAX_TOKENS_PER_FORWARD = 2048  # the scheduler's default --max-num-batched-tokens


@dataclass(slots=True)
class Proposal:
    """The step's sequences with their placeholders replaced by the drafts, and on rank 0 the draft
    distributions q [K, vocab] of every sequence whose drafts were drawn at random (greedy ones,
    and every sequence on the other ranks, have none)."""

    seqs: list[ScheduledSeq]
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)


def _drafting_position(seq: ScheduledSeq) -> int:
    """Position P of the last real token t; raises PlanError when the draft context does not end at P."""
    num_drafts = seq.num_draft_tokens
    if not 0 < num_drafts < len(seq.token_ids):
        raise PlanError(f"sequence {seq.seq_id}: {num_drafts} drafts among {len(seq.token_ids)} new tokens")
    position = seq.start_position + len(seq.token_ids) - num_drafts - 1
    if seq.draft_start_position < 0 or seq.draft_start_position + len(seq.draft_context_ids) != position:
        raise PlanError(f"sequence {seq.seq_id}: a draft context of {len(seq.draft_context_ids)} tokens from "
                        f"position {seq.draft_start_position} does not end before its last token at {position}")
    return position


def pick_drafts(sampler: Sampler, logits: torch.Tensor, specs: list[SampleSpec],
                positions: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
    """logits [rows, V] of the draft model, one spec (penalty history included) and drafted position
    per row -> (draft ids, q [V] of each random row, None for greedy ones). A row whose spec cannot be
    sampled is drafted greedily from its raw logits: verification reports its failure."""
    raw = logits.float()  # [rows, V]
    specs = list(specs)
    for row, spec in enumerate(specs):
        try:
            validate_spec(spec)
        except SamplerError:
            specs[row] = SampleSpec()
    processed = processed_logits(raw, specs)  # [rows, V]
    chosen = processed.argmax(dim=-1)  # [rows]; final for greedy rows
    draft_probs: list[torch.Tensor | None] = [None] * len(specs)
    random_rows = [row for row, spec in enumerate(specs) if not spec.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=raw.device)
        probs = sampling_probs(processed[index], [specs[row] for row in random_rows])  # [random, V]
        noise = torch.empty_like(probs)  # [random, V], Exp(1): the exponential race picks i w.p. q_i
        unseeded = [i for i, row in enumerate(random_rows) if specs[row].seed is None]
        if unseeded:
            noise[torch.tensor(unseeded, device=probs.device)] = torch.empty(
                (len(unseeded), probs.shape[1]), dtype=probs.dtype, device=probs.device).exponential_(
                generator=sampler.generator)
        for i, row in enumerate(random_rows):
            if specs[row].seed is not None:
                noise[i].exponential_(generator=seeded_generator(specs[row], positions[row], probs.device,
                                                                 salt=DRAFT_SALT))
        chosen[index] = (probs / noise).argmax(dim=-1)
        for i, row in enumerate(random_rows):
            draft_probs[row] = probs[i]
    return chosen.tolist(), draft_probs


class DraftProposer:
    """Runs the draft model over a step's drafting sequences (module docstring); `sampler` is rank 0's."""

    def __init__(self, draft: DraftModel, *, sampler: Sampler | None, tp: TensorParallelGroup, block_size: int,
                 device: torch.device, max_tokens_per_forward: int = DEFAULT_MAX_TOKENS_PER_FORWARD) -> None:
        if max_tokens_per_forward <= 0:
            raise ValueError(f"max_tokens_per_forward must be positive, not {max_tokens_per_forward}")
        self.draft = draft
        self.sampler = sampler
        self.tp = tp
        self.block_size = block_size
        self.device = device
        self.max_tokens_per_forward = max_tokens_per_forward

    def propose(self, seqs: list[ScheduledSeq], cache: CacheEngine) -> Proposal:
        """The step's sequences with drafts in place of the placeholders (all ranks), and q (rank 0)."""
        drafting = [seq for seq in seqs if seq.num_draft_tokens > 0 and seq.sample is not None]
        if not drafting:
            return Proposal(seqs=list(seqs))
        if not cache.draft_gpu_cache:
            raise PlanError("the KV cache has no draft part: init_cache ran before the draft model was loaded")
        positions = {seq.seq_id: _drafting_position(seq) for seq in drafting}
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq in drafting}
        probs: dict[int, list[torch.Tensor | None]] = {seq.seq_id: [] for seq in drafting}
        for seq_id, (token_id, q) in self._first_drafts(drafting, positions, cache).items():
            drafts[seq_id].append(token_id)
            probs[seq_id].append(q)
        for step in range(2, max(seq.num_draft_tokens for seq in drafting) + 1):
            active = [seq for seq in drafting if seq.num_draft_tokens >= step]
            inputs = [ScheduledSeq(seq.seq_id, [drafts[seq.seq_id][-1]], positions[seq.seq_id] + step - 1,
                                   seq.block_table, sample=seq.sample)
                      for seq in active]
            picked = self._forward_and_pick(inputs, [after_drafts(seq.sample, drafts[seq.seq_id])
                                                     for seq in active],
                                            [positions[seq.seq_id] + step for seq in active], cache)
            for seq, (token_id, q) in zip(active, picked):
                drafts[seq.seq_id].append(token_id)
                probs[seq.seq_id].append(q)
        filled = [dataclasses.replace(seq, token_ids=seq.token_ids[:-seq.num_draft_tokens] + drafts[seq.seq_id])
                  if seq.seq_id in drafts else seq for seq in seqs]
        draft_probs = {seq_id: torch.stack(rows) for seq_id, rows in probs.items()
                       if rows and all(row is not None for row in rows)}  # [K, V] each
        return Proposal(seqs=filled, draft_probs=draft_probs)

    def _first_drafts(self, drafting: list[ScheduledSeq], positions: dict[int, int],
                      cache: CacheEngine) -> dict[int, tuple[int, torch.Tensor | None]]:
        """Draft forward 1 (draft_context_ids + [t] of every drafting sequence) -> d1 and q1 per
        sequence. Long draft contexts (a catch-up after a prefix-cache hit or a preemption) are
        split into forwards of at most max_tokens_per_forward tokens, in order, so the draft's
        activations stay within the step's usual size; a sequence picks d1 in the forward holding t."""
        remaining = {seq.seq_id: (seq.draft_context_ids + [seq.token_ids[-seq.num_draft_tokens - 1]],
                                  seq.draft_start_position) for seq in drafting}
        picked: dict[int, tuple[int, torch.Tensor | None]] = {}
        while len(picked) < len(drafting):
            inputs, budget = [], self.max_tokens_per_forward
            for seq in drafting:
                tokens, start = remaining[seq.seq_id]
                if not tokens or budget <= 0:
                    continue
                take = min(len(tokens), budget)
                inputs.append(ScheduledSeq(seq.seq_id, tokens[:take], start, seq.block_table,
                                           sample=seq.sample if take == len(tokens) else None))
                remaining[seq.seq_id] = (tokens[take:], start + take)
                budget -= take
            sampled = [piece for piece in inputs if piece.sample is not None]
            results = self._forward_and_pick(inputs, [piece.sample for piece in sampled],
                                             [positions[piece.seq_id] + 1 for piece in sampled], cache)
            picked.update(zip([piece.seq_id for piece in sampled], results))
        return picked

    def _forward_and_pick(self, inputs: list[ScheduledSeq], specs: list[SampleSpec], positions: list[int],
                          cache: CacheEngine) -> list[tuple[int, torch.Tensor | None]]:
        """One draft forward; rank 0 picks a draft for each sequence that samples (`specs` and
        `positions` are theirs, in order), every rank gets the ids."""
        model = self.draft.model
        batch = build_model_input(inputs, block_size=self.block_size, num_blocks=cache.num_gpu_blocks,
                                  max_positions=model.max_positions, device=self.device)
        logits = self.draft.logits(batch.token_ids, batch.metadata, cache.draft_gpu_cache)  # [n, V] on rank 0
        if not batch.num_sampled:
            return []
        token_ids = torch.empty(batch.num_sampled, dtype=torch.int64, device=self.device)  # [n]
        qs: list[torch.Tensor | None] = [None] * batch.num_sampled
        if self.sampler is not None and logits is not None:
            ids, qs = pick_drafts(self.sampler, logits, specs, positions)
            token_ids.copy_(torch.tensor(ids, dtype=torch.int64))
        self.tp.broadcast_from_first(token_ids)
        return list(zip(token_ids.tolist(), qs))
