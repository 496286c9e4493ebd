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

from pagedserve.step_plan import SampleSpec, SeqFailure, SeqSample
from pagedserve.worker.model_input import ModelInput
from pagedserve.worker.rejection_sampler import rejection_sample
from pagedserve.worker.sampler import Sampler, processed_logits, sampling_probs, seeded_generator, validate_spec
from pagedserve.worker.spec_verify import row_specs, verify_one_hot

VERIFY_SALT = 0x766572696679  # "verify": the seeded verification draws' own stream


def sample_verifying_drafts(sampler: Sampler, logits: torch.Tensor, inputs: ModelInput,
                            draft_probs: dict[int, torch.Tensor]) -> tuple[list[SeqSample], list[SeqFailure]]:
    """logits [rows, vocab] of a step with drafts, q [K, vocab] per sequence drafted at random ->
    the emitted tokens of every sequence (one SeqSample each, sequences in order) and the failures."""
    one_hot_rows: list[int] = []
    one_hot_drafts: list[list[int]] = []
    general: list[tuple[int, int, list[int]]] = []  # (sequence, its first row, its drafts)
    order: list[int] = []
    index = 0
    for drafts in inputs.sample_draft_ids:
        seq_id = inputs.sample_seq_ids[index]
        order.append(seq_id)
        if seq_id in draft_probs:
            general.append((seq_id, index, drafts))
        else:
            one_hot_rows.extend(range(index, index + len(drafts) + 1))
            one_hot_drafts.append(drafts)
        index += len(drafts) + 1
    by_seq: dict[int, list[SeqSample]] = {}
    failures: list[SeqFailure] = []
    if one_hot_rows:
        rows = torch.tensor(one_hot_rows, device=logits.device)
        samples, failures = verify_one_hot(
            sampler, logits.index_select(0, rows), one_hot_drafts, [inputs.sample_seq_ids[r] for r in one_hot_rows],
            [inputs.sample_specs[r] for r in one_hot_rows], [inputs.sample_positions[r] for r in one_hot_rows])
        for sample in samples:
            by_seq.setdefault(sample.seq_id, []).append(sample)
    for seq_id, first, drafts in general:
        num_rows = len(drafts) + 1
        try:
            by_seq[seq_id] = _rejection_verify(sampler, logits[first:first + num_rows], inputs.sample_specs[first],
                                               drafts, draft_probs[seq_id], seq_id, inputs.sample_positions[first])
        except Exception as exc:
            failures.append(SeqFailure(seq_id, f"sampling failed: {type(exc).__name__}: {exc}"))
    return [sample for seq_id in order for sample in by_seq.get(seq_id, [])], failures


def _rejection_verify(sampler: Sampler, logits: torch.Tensor, spec: SampleSpec, drafts: list[int],
                      draft_probs: torch.Tensor, seq_id: int, first_position: int) -> list[SeqSample]:
    """logits [K + 1, V] of one sequence, q [K, V] -> its emitted tokens."""
    validate_spec(spec)
    specs = row_specs([spec], [drafts])  # K + 1 rows
    raw = logits.float()  # [K + 1, V]
    target_probs = sampling_probs(processed_logits(raw, specs), specs)  # [K + 1, V]
    generator = (sampler.generator if spec.seed is None
                 else seeded_generator(spec, first_position, raw.device, salt=VERIFY_SALT))
    draft_ids = torch.tensor([drafts], dtype=torch.int64, device=raw.device)  # [1, K]
    num_accepted, emitted = rejection_sample(target_probs[None], draft_ids,
                                             draft_probs.to(device=raw.device, dtype=raw.dtype)[None], generator)
    token_ids = emitted[0, :int(num_accepted[0]) + 1]  # [a + 1]
    logprobs = raw[:len(token_ids)].log_softmax(dim=-1)  # [a + 1, V]
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0].tolist()
    samples = []
    for row, (token_id, logprob) in enumerate(zip(token_ids.tolist(), chosen)):
        top_ids, top_logprobs = [], []
        if spec.num_logprobs:
            values, ids = logprobs[row].topk(min(spec.num_logprobs, logprobs.shape[-1]))
            top_ids, top_logprobs = ids.tolist(), values.tolist()
        samples.append(SeqSample(seq_id=seq_id, token_id=token_id, logprob=logprob, top_token_ids=top_ids,
                                 top_logprobs=top_logprobs))
    return samples
