"""Speculative decoding, worker side: verification of drafts proposed by the scheduler.

A sequence with drafts d1..dk has k + 1 logits rows (model_input.py): row i is the target
model's distribution p_i of the token after d_i (row 0: after the last real token). Each row is
sampled exactly as a plain decode of that position would be (Sampler.sample: penalties counting
the drafts before the row as outputs, suppression, temperature, top-k/p, min-p; a seeded row
draws from the generator of (seed, output index, position)), giving t_0..t_k. Then

    accepted a = the first i with t_i != d(i+1) (k when all match); emitted t_0 .. t_a

which is the rejection sampler for a one-hot draft distribution q = onehot(d): d(i+1) is
accepted with probability p_i(d(i+1)) = min(1, p/q), and on rejection t_i is distributed as
p_i restricted to tokens != d(i+1), i.e. normalize(max(0, p_i - q)) (rejection_sampler.py has
the general-q form and the statistical test). Greedy rows accept while the draft is the argmax.
Because every row is drawn as it would be without speculation, a seeded request gives the same
tokens with speculation on and off.

Drafts drawn at random by a draft model come with their distributions q and are verified by the
general rejection sampler instead (draft_verify.py).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.contracts.step_plan import SampleSpec, SeqFailure, SeqSample
from pagedserve.worker.model_input import ModelInput
from pagedserve.worker.speculation.rejection_sampler import num_accepted_one_hot
from pagedserve.worker.sampler import Sampler, has_penalties


def after_drafts(spec: SampleSpec, drafts: list[int]) -> SampleSpec:
    """The spec of the row after `drafts`: with penalties, the drafts count as outputs."""
    if not drafts or not has_penalties(spec):
        return spec
    return dataclasses.replace(spec, output_token_ids=spec.output_token_ids + drafts)


def row_specs(specs: list[SampleSpec], draft_ids: list[list[int]]) -> list[SampleSpec]:
    """The spec of every row: row i counts the drafts before it as outputs (after_drafts)."""
    out: list[SampleSpec] = []
    index = 0
    for drafts in draft_ids:
        spec = specs[index]
        out += [after_drafts(spec, drafts[:offset]) for offset in range(len(drafts) + 1)]
        index += len(drafts) + 1
    return out


def sample_verifying(sampler: Sampler, logits: torch.Tensor,
                     inputs: ModelInput) -> tuple[list[SeqSample], list[SeqFailure]]:
    """logits [rows, vocab] of a step with drafts -> the emitted tokens of every sequence (one
    SeqSample each, in order) and the sequences whose sampling failed."""
    return verify_one_hot(sampler, logits, inputs.sample_draft_ids, inputs.sample_seq_ids, inputs.sample_specs,
                           inputs.sample_positions)


def verify_one_hot(sampler: Sampler, logits: torch.Tensor, draft_ids: list[list[int]], seq_ids: list[int],
                    specs: list[SampleSpec], positions: list[int]) -> tuple[list[SeqSample], list[SeqFailure]]:
    """sample_verifying over rows given as lists (one entry per logits row; draft_ids per sequence)."""
    samples, failures = sampler.sample_isolating_failures(logits, row_specs(specs, draft_ids), seq_ids, positions)
    failed = {failure.seq_id for failure in failures}
    by_seq: dict[int, list[SeqSample]] = {}
    for sample in samples:
        by_seq.setdefault(sample.seq_id, []).append(sample)
    out: list[SeqSample] = []
    index = 0
    for drafts in draft_ids:
        seq_id = seq_ids[index]
        index += len(drafts) + 1
        if seq_id in failed:
            continue
        rows = by_seq[seq_id]
        num_accepted = num_accepted_one_hot([sample.token_id for sample in rows], drafts)
        out.extend(rows[:num_accepted + 1])
    unique_failures = list({failure.seq_id: failure for failure in failures}.values())
    return out, unique_failures
