"""The rejection sampler of speculative decoding (Leviathan et al. 2023, Chen et al. 2023), as
pure functions over a batch.

For drafts d_1..d_K drawn from draft distributions q_1..q_K and the target's distributions
p_1..p_(K+1) at the same positions (fully processed: penalties, temperature, top-k/p, min-p):

    for i = 1..K:  accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); stop at the first rejection
    rejected at i: emit a token drawn from normalize(max(0, p_i - q_i))
    all accepted:  emit a bonus token drawn from p_(K+1)

Every emitted token is distributed exactly as sampling from the target alone would give. With
n-gram proposals q_i is one-hot at d_i: accept with probability p_i(d_i), on rejection draw from
p_i with d_i removed. The serving path (spec_verify.py) realises that one-hot case by drawing
t_i ~ p_i for every row with the sampler's own noise and accepting while t_i == d_i
(num_accepted_one_hot): the same distribution, and a seeded row draws what it would draw
without speculation.
"""

from __future__ import annotations

import torch


def num_accepted_one_hot(target_ids: list[int], draft_ids: list[int]) -> int:
    """Drafts accepted when the target's own draw t_i at each row must equal the draft d_(i+1)."""
    num_accepted = 0
    for target_id, draft_id in zip(target_ids, draft_ids):
        if target_id != draft_id:
            break
        num_accepted += 1
    return num_accepted


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [N, K + 1, V], draft_ids [N, K] int64, draft_probs [N, K, V] or None (one-hot)
    -> (num_accepted [N], emitted [N, K + 1] with -1 after the last emitted token)."""
    num_rows, num_positions, vocab_size = target_probs.shape
    num_drafts = num_positions - 1
    rows = torch.arange(num_rows, device=target_probs.device)  # [N]
    p_draft = target_probs[:, :num_drafts].gather(2, draft_ids[:, :, None])[:, :, 0]  # [N, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)  # [N, K]
    else:
        q_draft = draft_probs.gather(2, draft_ids[:, :, None])[:, :, 0]  # [N, K]
    uniform = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)  # [N, K]
    accepted = uniform * q_draft < p_draft  # [N, K]; u < p / q without dividing by q
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [N]
    p_last = target_probs[rows, num_accepted]  # [N, V]
    is_rejected = num_accepted < num_drafts  # [N]
    at = num_accepted.clamp(max=max(num_drafts - 1, 0))  # [N]
    if num_drafts == 0:
        q_last = torch.zeros_like(p_last)
    elif draft_probs is None:
        q_last = torch.zeros_like(p_last).scatter_(1, draft_ids[rows, at][:, None], 1.0)  # [N, V]
    else:
        q_last = draft_probs[rows, at]  # [N, V]
    q_last = q_last * is_rejected[:, None]  # [N, V]; the bonus row draws from p itself
    residual = (p_last - q_last).clamp(min=0)  # [N, V]
    mass = residual.sum(dim=1, keepdim=True)  # [N, 1]
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_last)  # p == q: any draw from p
    final = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [N]
    emitted = torch.full((num_rows, num_positions), -1, dtype=torch.int64, device=target_probs.device)
    if num_drafts:
        emitted[:, :num_drafts] = torch.where(
            torch.arange(num_drafts, device=target_probs.device)[None, :] < num_accepted[:, None], draft_ids, -1)
    emitted[rows, num_accepted] = final
    return num_accepted, emitted
