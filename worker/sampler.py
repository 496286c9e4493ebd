"""Picks the next token of each sampling sequence from its logits row, per its SampleSpec.

Per row, in this order:

    raw logits --> repetition penalty (prompt + output) --> presence/frequency penalties (output)
               --> suppress_token_ids = -inf                                    = "processed"
    greedy:       argmax(processed)                       (ties: the lowest id, like torch.argmax)
    random:       processed / temperature --> top-k --> top-p --> min-p --> draw
    beam search:  top num_beam_candidates of log_softmax(raw), suppressed ids excluded; the best
                  one is the chosen token

Reported log-probabilities are always those of the model's distribution, log_softmax(raw).

Drawing uses the exponential race: token = argmax(p / E) with E_i ~ Exp(1) i.i.d. picks token i
with probability p_i. A seeded row fills its E from a generator seeded by
hash(seed, output_index, position of the token being sampled), so its token depends only on its
own logits and never on what else is in the batch; unseeded rows share the sampler's generator.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from pagedserve.contracts.step_plan import SampleSpec, SeqFailure, SeqSample
from pagedserve.kernels import ops




class SamplerError(ValueError):
    pass


def derive_seed(seed: int, output_index: int, position: int, salt: int = 0) -> int:
    """A 63-bit generator seed from (request seed, output index, token position); a non-zero salt
    gives another stream for the same triple (speculation's draft and verification draws), so
    those draws never reuse the noise of the token's own draw."""
    values = (seed, output_index, position) + ((salt,) if salt else ())
    packed = struct.pack(f"<{len(values)}Q", *(value % (1 << 64) for value in values))
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1


def seeded_generator(spec: SampleSpec, position: int, device: torch.device, salt: int = 0) -> torch.Generator:
    """The generator of a seeded row: derive_seed(spec.seed, spec.output_index, position, salt)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(spec.seed, spec.output_index, position, salt))
    return generator


def _validate(spec: SampleSpec) -> None:
    if spec.temperature < 0:
        raise SamplerError(f"temperature must be >= 0, not {spec.temperature}")
    if not 0.0 < spec.top_p <= 1.0:
        raise SamplerError(f"top_p must be in (0, 1], not {spec.top_p}")
    if spec.top_k < 0 or spec.num_logprobs < 0 or spec.num_beam_candidates < 0:
        raise SamplerError("top_k, num_logprobs and num_beam_candidates must be >= 0")
    if not 0.0 <= spec.min_p <= 1.0:
        raise SamplerError(f"min_p must be in [0, 1], not {spec.min_p}")
    if spec.repetition_penalty <= 0:
        raise SamplerError(f"repetition_penalty must be > 0, not {spec.repetition_penalty}")


def has_penalties(spec: SampleSpec) -> bool:
    return spec.repetition_penalty != 1.0 or spec.presence_penalty != 0.0 or spec.frequency_penalty != 0.0


def is_plain_greedy(spec: SampleSpec) -> bool:
    """Greedy with nothing that changes the argmax or asks for more than the chosen token."""
    return (spec.is_greedy and not has_penalties(spec) and not spec.suppress_token_ids
            and spec.num_logprobs == 0 and spec.num_beam_candidates == 0)


def _padded_ids(id_lists: list[list[int]], pad: int) -> torch.Tensor:  # [rows, max_len] int64
    width = max((len(ids) for ids in id_lists), default=0)
    table = np.full((len(id_lists), max(width, 1)), pad, dtype=np.int64)
    for row, ids in enumerate(id_lists):
        table[row, : len(ids)] = ids
    return torch.from_numpy(table)


def apply_penalties(logits: torch.Tensor, specs: list[SampleSpec]) -> None:
    """In place on logits [rows, vocab], one spec per row.

    Repetition (Hugging Face): a token seen in prompt or output has its logit divided by the
    penalty when positive, multiplied when negative. Presence/frequency (OpenAI): over output
    tokens, logit -= presence * (count > 0) + frequency * count.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    seen_ids = _padded_ids([spec.prompt_token_ids + spec.output_token_ids for spec in specs], vocab_size).to(device)
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)  # [rows, V + 1]
    seen.scatter_(1, seen_ids, True)
    seen = seen[:, :vocab_size]  # [rows, V], the padding column dropped
    penalty = torch.tensor([spec.repetition_penalty for spec in specs], dtype=logits.dtype, device=device)[:, None]
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)  # [rows, V]
    logits.copy_(torch.where(seen, penalised, logits))
    output_ids = _padded_ids([spec.output_token_ids for spec in specs], vocab_size).to(device)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=device)  # [rows, V + 1]
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab_size]  # [rows, V]
    presence = torch.tensor([spec.presence_penalty for spec in specs], dtype=logits.dtype, device=device)[:, None]
    frequency = torch.tensor([spec.frequency_penalty for spec in specs], dtype=logits.dtype, device=device)[:, None]
    logits.sub_(presence * (counts > 0) + frequency * counts)


def restrict_support(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf) on logits [rows, vocab] -> [rows, vocab]."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    temperature = torch.tensor([spec.temperature for spec in specs], dtype=logits.dtype, device=device)
    logits = logits / temperature[:, None]  # [rows, V]
    top_k = [spec.top_k if 0 < spec.top_k < vocab_size else vocab_size for spec in specs]
    if min(top_k) < vocab_size:
        ks = torch.tensor(top_k, device=device)[:, None]  # [rows, 1]
        kth_values = logits.topk(max(top_k), dim=-1).values.gather(1, ks - 1)  # [rows, 1]
        logits = logits.masked_fill(logits < kth_values, float("-inf"))
    if any(spec.top_p < 1.0 for spec in specs):
        top_p = torch.tensor([spec.top_p for spec in specs], dtype=logits.dtype, device=device)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, V] each
        sorted_probs = sorted_logits.softmax(dim=-1)  # [rows, V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [rows, V]
        drop_sorted = mass_before > top_p  # [rows, V]; the most likely token is always kept
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)  # [rows, V]
        logits = logits.masked_fill(drop, float("-inf"))
    if any(spec.min_p > 0.0 for spec in specs):
        min_p = torch.tensor([spec.min_p for spec in specs], dtype=logits.dtype, device=device)[:, None]
        probs = logits.softmax(dim=-1)  # [rows, V]
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def validate_spec(spec: SampleSpec) -> None:
    """Raises SamplerError for a spec no row can be sampled with."""
    _validate(spec)


def processed_logits(raw: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """raw [rows, V] float -> penalised logits with suppressed ids at -inf ("processed" above);
    raw itself when nothing applies."""
    return Sampler._processed(raw, specs)


def sampling_probs(processed: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """processed [rows, V] -> the distribution a random row draws from [rows, V]: temperature,
    top-k, top-p, min-p applied, then softmax (what speculation's rejection sampler calls p and q)."""
    return restrict_support(processed, specs).softmax(dim=-1)


class Sampler:
    """Samples a batch of rows; `seed` fixes the generator of unseeded rows (random if None)."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def _draw(self, logits: torch.Tensor, specs: list[SampleSpec], positions: list[int]) -> torch.Tensor:
        """logits [rows, V] (penalised) -> sampled ids [rows]."""
        probs = sampling_probs(logits, specs)  # [rows, V]
        noise = torch.empty_like(probs)  # [rows, V], Exp(1)
        unseeded = [row for row, spec in enumerate(specs) if spec.seed is None]
        if unseeded:
            rows = torch.tensor(unseeded, device=probs.device)
            noise[rows] = torch.empty((len(unseeded), probs.shape[1]), dtype=probs.dtype,
                                      device=probs.device).exponential_(generator=self.generator)
        for row, (spec, position) in enumerate(zip(specs, positions)):
            if spec.seed is not None:
                noise[row].exponential_(generator=seeded_generator(spec, position, probs.device))
        return (probs / noise).argmax(dim=-1)  # [rows]

    def sample_isolating_failures(self, logits: torch.Tensor, specs: list[SampleSpec], seq_ids: list[int],
                                  positions: list[int]) -> tuple[list[SeqSample], list[SeqFailure]]:
        """sample(), but a row whose sampling raises fails alone: the batch is sampled again row
        by row (rows are independent, so the others get the same tokens) and each failing row
        becomes a SeqFailure for the scheduler to fail its request with."""
        try:
            return self.sample(logits, specs, seq_ids, positions), []
        except Exception:
            pass
        samples, failures = [], []
        for row, (spec, seq_id, position) in enumerate(zip(specs, seq_ids, positions)):
            try:
                samples += self.sample(logits[row:row + 1], [spec], [seq_id], [position])
            except Exception as exc:
                failures.append(SeqFailure(seq_id, f"sampling failed: {type(exc).__name__}: {exc}"))
        return samples, failures

    def sample(self, logits: torch.Tensor, specs: list[SampleSpec], seq_ids: list[int],
               positions: list[int]) -> list[SeqSample]:
        """logits [rows, vocab] with one spec, sequence id and position (of the sampled token) per row."""
        num_rows = logits.shape[0]
        if not len(specs) == len(seq_ids) == len(positions) == num_rows:
            raise SamplerError(f"{num_rows} logits rows, {len(specs)} specs, {len(seq_ids)} ids, {len(positions)} positions")
        if num_rows == 0:
            return []
        distinct = list({id(spec): spec for spec in specs}.values())  # plans share equal specs
        for spec in distinct:
            _validate(spec)
        if all(is_plain_greedy(spec) for spec in distinct):
            return self._sample_greedy(logits, seq_ids)
        raw = logits.float()  # [rows, V]
        processed = self._processed(raw, specs)  # [rows, V]
        is_beam = [spec.num_beam_candidates > 0 for spec in specs]
        is_random = [not beam and not spec.is_greedy for spec, beam in zip(specs, is_beam)]
        chosen = processed.argmax(dim=-1)  # [rows]; final for greedy rows
        if any(is_random):
            rows = [row for row, flag in enumerate(is_random) if flag]
            random_index = torch.tensor(rows, device=raw.device)
            chosen[random_index] = self._draw(processed[random_index], [specs[r] for r in rows],
                                              [positions[r] for r in rows])
        top_rows = [row for row, spec in enumerate(specs) if spec.num_logprobs > 0 or spec.num_beam_candidates > 0]
        beam_ids, beam_logprobs, top_ids, top_logprobs = {}, {}, {}, {}
        if top_rows:
            top_index = torch.tensor(top_rows, device=raw.device)
            logprobs = raw[top_index].log_softmax(dim=-1)  # [top_rows, V]
            for i, row in enumerate(top_rows):
                spec = specs[row]
                if spec.num_logprobs:
                    values, ids = logprobs[i].topk(min(spec.num_logprobs, logprobs.shape[-1]))
                    top_ids[row], top_logprobs[row] = ids.tolist(), values.tolist()
                if spec.num_beam_candidates:
                    candidates = logprobs[i]
                    if spec.suppress_token_ids:
                        candidates = candidates.index_fill(0, torch.tensor(spec.suppress_token_ids, device=raw.device),
                                                           float("-inf"))
                    # never more candidates than tokens left (EOS ids add to the stop ids)
                    num_allowed = candidates.shape[-1] - len(set(spec.suppress_token_ids))
                    values, ids = candidates.topk(max(1, min(spec.num_beam_candidates, num_allowed)))
                    beam_ids[row], beam_logprobs[row] = ids.tolist(), values.tolist()
        if beam_ids:
            beam_rows = list(beam_ids)
            chosen[torch.tensor(beam_rows, device=raw.device)] = torch.tensor(
                [beam_ids[row][0] for row in beam_rows], device=raw.device)
        chosen_logprobs = raw.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(raw, dim=-1)  # [rows]
        if top_rows:
            chosen_logprobs[top_index] = logprobs.gather(1, chosen[top_index][:, None])[:, 0]
        chosen_ids, chosen_logprobs = chosen.tolist(), chosen_logprobs.tolist()
        return [
            SeqSample(seq_id=seq_id, token_id=chosen_ids[row], logprob=chosen_logprobs[row],
                      top_token_ids=top_ids.get(row, []), top_logprobs=top_logprobs.get(row, []),
                      beam_token_ids=beam_ids.get(row, []), beam_logprobs=beam_logprobs.get(row, []))
            for row, seq_id in enumerate(seq_ids)
        ]

    @staticmethod
    def _sample_greedy(logits: torch.Tensor, seq_ids: list[int]) -> list[SeqSample]:
        """logits [rows, V]: one max and one exp-sum per row for a batch that needs nothing else
        (ops.greedy: the native kernel on the CPU). The chosen token's logprob is max - logsumexp =
        -log(sum(exp(raw - max))); the first maximal index, as argmax gives it."""
        chosen_ids, chosen_logprobs = ops.greedy(logits)
        return [SeqSample(seq_id=seq_id, token_id=token_id, logprob=logprob)
                for seq_id, token_id, logprob in zip(seq_ids, chosen_ids, chosen_logprobs)]

    @staticmethod
    def _processed(raw: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
        """raw [rows, V] -> penalised logits with suppressed ids at -inf (raw itself when nothing applies)."""
        penalised_rows = [row for row, spec in enumerate(specs) if has_penalties(spec)]
        suppressed = [(row, token) for row, spec in enumerate(specs) for token in spec.suppress_token_ids]
        if not penalised_rows and not suppressed:
            return raw
        processed = raw.clone()
        if penalised_rows:
            index = torch.tensor(penalised_rows, device=raw.device)
            rows = processed[index]  # [penalised, V]
            apply_penalties(rows, [specs[row] for row in penalised_rows])
            processed[index] = rows
        if suppressed:
            rows, tokens = zip(*suppressed)
            processed[torch.tensor(rows, device=raw.device), torch.tensor(tokens, device=raw.device)] = float("-inf")
        return processed
