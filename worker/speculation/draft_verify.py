"""Draft-model speculation, verifying: the emitted tokens of a step whose drafts the worker's draft
model proposed (draft_proposer.py).

Per drafting sequence with drafts d1..dK, the target's K + 1 logits rows (model_input.py) give
p_1..p_(K+1), each processed exactly as that position would be sampled (spec_verify.row_specs:
penalties counting the drafts before the row as outputs, suppression, temperature, top-k/p,
min-p). Then

    greedy drafts (no q)   one-hot verification, as for n-gram drafts (spec_verify.py): accept
                           while d_i equals the target's argmax, then emit the target's token
    random drafts (q)      the rejection sampler (rejection_sampler.py): accept d_i with
                           probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a
                           draw from normalize(max(0, p_i - q_i)); all K accepted: a bonus draw
                           from p_(K+1)

so every emitted token is distributed as the target alone would sample it. A seeded sequence's
uniforms and final draw come from the generator of (seed, output index, position of the first
token it emits) salted with VERIFY_SALT, so its tokens depend only on its own rows; unseeded
sequences use the sampler's generator. Each emitted token is one SeqSample, with the
log-probabilities of the model's distribution log_softmax(raw) as any sampled token.
"""

from __future__ import annotations

import torch

from pagedserve.contracts.step_plan import SampleSpec, SeqFailure, SeqSample
from pagedserve.worker.model_input import ModelInput
from pagedserve.worker.speculation.rejection_sampler import rejection_sample
from pagedserve.worker.sampler import Sampler, processed_logits, sampling_probs, seeded_generator, validate_spec
from pagedserve.worker.speculation.ngram_verify import row_specs, verify_one_hot

VERIFY_SALT = 0x766572696679  # "verify": the seeded verification draws' own stream


def sample_verifying_drafts(sampler: Sampler, logits: torch.Tensor, inputs: ModelInput,
                            draft_probs: dict[int, torch.Tensor]) -> tuple[list[SeqSample], list[SeqFailure]]:
    """logits [rows, vocab] of a step with drafts, q [K, vocab] per sequence drafted at random ->
    the emitted tokens of every sequence (one SeqSample each, sequences in order) and the failures."""
    one_hot_rows: list[int] = []
    one_hot_drafts: list[list[int]] = []
    general: list[tuple[int, int, list[int]]] = []  # (sequence, its first row, its drafts)
    order: list[int] = []
    failures: list[SeqFailure] = []
    index = 0
    for drafts in inputs.sample_draft_ids:
        seq_id = inputs.sample_seq_ids[index]
        order.append(seq_id)
        if seq_id not in draft_probs:
            one_hot_rows.extend(range(index, index + len(drafts) + 1))
            one_hot_drafts.append(drafts)
        else:
            try:
                validate_spec(inputs.sample_specs[index])
                general.append((seq_id, index, drafts))
            except Exception as exc:
                failures.append(SeqFailure(seq_id, f"sampling failed: {type(exc).__name__}: {exc}"))
        index += len(drafts) + 1
    by_seq: dict[int, list[SeqSample]] = {}
    if one_hot_rows:
        rows = torch.tensor(one_hot_rows, device=logits.device)
        samples, one_hot_failures = verify_one_hot(
            sampler, logits.index_select(0, rows), one_hot_drafts, [inputs.sample_seq_ids[r] for r in one_hot_rows],
            [inputs.sample_specs[r] for r in one_hot_rows], [inputs.sample_positions[r] for r in one_hot_rows])
        failures += one_hot_failures
        for sample in samples:
            by_seq.setdefault(sample.seq_id, []).append(sample)
    if general:
        try:
            by_seq.update(_rejection_verify(sampler, logits, inputs, general, draft_probs))
        except Exception:  # each sequence alone, so that one failing row fails only its request
            for seq in general:
                try:
                    by_seq.update(_rejection_verify(sampler, logits, inputs, [seq], draft_probs))
                except Exception as exc:
                    failures.append(SeqFailure(seq[0], f"sampling failed: {type(exc).__name__}: {exc}"))
    return [sample for seq_id in order for sample in by_seq.get(seq_id, [])], failures


def _rejection_verify(sampler: Sampler, logits: torch.Tensor, inputs: ModelInput,
                      general: list[tuple[int, int, list[int]]],
                      draft_probs: dict[int, torch.Tensor]) -> dict[int, list[SeqSample]]:
    """The emitted tokens of sequences drafted at random: (sequence, first row, drafts) each, their
    rows' p from logits [rows, V], q from draft_probs [K, V]. Unseeded sequences with the same K
    share one batched rejection_sample call; a seeded one draws alone from its own generator."""
    row_index = [row for _, first, drafts in general for row in range(first, first + len(drafts) + 1)]
    specs = row_specs([inputs.sample_specs[row] for row in row_index], [drafts for _, _, drafts in general])
    raw = logits.index_select(0, torch.tensor(row_index, device=logits.device)).float()  # [R, V]
    target_probs = sampling_probs(processed_logits(raw, specs), specs)  # [R, V]
    logprobs = raw.log_softmax(dim=-1)  # [R, V]
    starts, offset = [], 0
    for _, _, drafts in general:
        starts.append(offset)
        offset += len(drafts) + 1
    groups: dict[object, list[int]] = {}  # unseeded: by K; seeded: alone
    for number, (seq_id, first, drafts) in enumerate(general):
        spec = inputs.sample_specs[first]
        groups.setdefault(len(drafts) if spec.seed is None else ("seeded", seq_id), []).append(number)
    out: dict[int, list[SeqSample]] = {}
    for members in groups.values():
        num_drafts = len(general[members[0]][2])
        spans = torch.tensor([[starts[m] + j for j in range(num_drafts + 1)] for m in members],
                             device=raw.device)  # [N, K + 1]
        draft_ids = torch.tensor([general[m][2] for m in members], dtype=torch.int64, device=raw.device)  # [N, K]
        q = torch.stack([draft_probs[general[m][0]] for m in members]).to(device=raw.device, dtype=raw.dtype)
        seq_id, first, _ = general[members[0]]
        spec = inputs.sample_specs[first]
        generator = (sampler.generator if spec.seed is None
                     else seeded_generator(spec, inputs.sample_positions[first], raw.device, salt=VERIFY_SALT))
        num_accepted, emitted = rejection_sample(target_probs[spans], draft_ids, q, generator)  # [N], [N, K + 1]
        for m, accepted, tokens in zip(members, num_accepted.tolist(), emitted.tolist()):
            seq_id, first, _ = general[m]
            out[seq_id] = _samples(seq_id, inputs.sample_specs[first], tokens[:accepted + 1], logprobs, starts[m])
    return out


def _samples(seq_id: int, spec: SampleSpec, token_ids: list[int], logprobs: torch.Tensor,
             start: int) -> list[SeqSample]:
    """One SeqSample per emitted token, its row's logprobs [R, V] starting at row `start`."""
    rows = logprobs[start:start + len(token_ids)]  # [a + 1, V]
    chosen = rows.gather(1, torch.tensor(token_ids, device=rows.device)[:, None])[:, 0].tolist()
    samples = []
    for row, (token_id, logprob) in enumerate(zip(token_ids, chosen)):
        top_ids, top_logprobs = [], []
        if spec.num_logprobs:
            values, ids = rows[row].topk(min(spec.num_logprobs, rows.shape[-1]))
            top_ids, top_logprobs = ids.tolist(), values.tolist()
        samples.append(SeqSample(seq_id=seq_id, token_id=token_id, logprob=logprob, top_token_ids=top_ids,
                                 top_logprobs=top_logprobs))
    return samples
