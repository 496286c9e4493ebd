"""SampleSpec of a sequence that samples in a step: the request's sampling parameters plus the
per-sequence parts (output index for seeded sampling, min_tokens suppression, penalty history).
The history of a sequence with proposals in flight ends before them: the worker's verification
counts the drafts before each row itself (worker/speculation/ngram_verify.py row_specs).

A spec without penalties changes at most once (when min_tokens is reached), so it is built once
per sequence and reused; the wire codec only reads it.
"""

from __future__ import annotations

from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup
from pagedserve.contracts.step_plan import SampleSpec


def sample_spec_for(group: SequenceGroup, seq: Sequence) -> SampleSpec:
    sampling = group.request.sampling
    num_outputs = seq.num_output_tokens - seq.num_draft_tokens  # proposals in flight are not outputs yet
    is_suppressing = num_outputs < sampling.min_tokens and bool(group.stop_token_ids)
    has_penalties = sampling.has_penalties
    spec = seq.sample_spec
    if spec is not None and not has_penalties and bool(spec.suppress_token_ids) == is_suppressing:
        return spec
    spec = SampleSpec(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        seed=sampling.seed,
        output_index=seq.output_index,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        num_logprobs=sampling.logprobs,
        num_beam_candidates=group.beam.num_candidates if group.beam is not None else 0,
        suppress_token_ids=sorted(group.stop_token_ids) if is_suppressing else [],
        prompt_token_ids=group.request.prompt_token_ids if has_penalties else [],
        output_token_ids=seq.token_ids[seq.num_prompt_tokens:seq.num_prompt_tokens + num_outputs]
        if has_penalties else [],
        logit_bias=sampling.logit_bias,
    )
    if not has_penalties:
        seq.sample_spec = spec
    return spec
