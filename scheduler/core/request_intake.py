"""Turns a Request into a SequenceGroup, or rejects it when it could never be served.

A group must fit the GPU pool on its own, or it could be preempted forever. Its worst case is
every sequence at full length, sharing only the prompt's full blocks that are computed once:

    blocks per sequence  B = ceil((prompt + max_tokens - 1) / block_size)   (the last sampled
                                                                              token is never computed)
    shared blocks        S = floor(prompt / block_size)        beam search (all of the prompt)
                             floor((prompt - 1) / block_size)  n > 1 (the last prompt token is
                                                                       computed per sample)
    worst case           S + m * (B - S)   for m = n or beam_width sequences (B for m = 1)

A continuation (the request resubmitted after its scheduler was lost) starts each listed output
index from its generated tokens instead of the bare prompt, and leaves out the indices that
finished already:

    sequence of index i   token_ids = prompt + generated_i   num_prompt_tokens = len(prompt)

so max_tokens, min_tokens and stop token ids count the generated tokens, penalties see them as
outputs, and the next token's position (which keys seeded sampling with the output index) is the
one it had before. The group computes the sequences' common prefix once, then forks (as after a
preemption by recomputation). The worst case above still bounds it.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.contracts.prefix_hash import adapter_root_key
from pagedserve.contracts.request_types import Continuation, Request
from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.scheduler.beam.search import BeamSearchState
from pagedserve.scheduler.core.errors import RequestRejected
from pagedserve.scheduler.core.config import SchedulerConfig
from pagedserve.scheduler.core.sequence import Sequence, SequenceGroup


def max_group_blocks(config: SchedulerConfig, num_prompt_tokens: int, max_tokens: int,
                     num_seqs: int, is_beam_search: bool) -> int:
    size = config.block_size
    per_seq = config.num_blocks_for(num_prompt_tokens + max_tokens - 1)
    if num_seqs == 1:
        return per_seq
    shared = (num_prompt_tokens if is_beam_search else num_prompt_tokens - 1) // size
    return shared + num_seqs * (per_seq - shared)


def build_group(request: Request, config: SchedulerConfig, *, arrival_index: int,
                next_seq_id: Callable[[], int]) -> SequenceGroup:
    """A waiting group for request; raises RequestRejected with the reason it can never run."""
    request_id = request.request_id
    sampling = request.sampling
    try:
        sampling.validate()
    except InvalidParameter as error:
        raise RequestRejected(request_id, str(error)) from error
    if request.adapter is not None and not config.enable_lora:
        raise RequestRejected(request_id, f"LoRA adapter {request.adapter.name!r} asked for, and this scheduler "
                                          "serves no adapters (--enable-lora)")
    if request.adapter is not None and config.is_draft_model_speculation:
        raise RequestRejected(request_id, f"LoRA adapter {request.adapter.name!r}: adapter requests are not served "
                                          "with --speculative-method draft (the draft model has no adapter)")
    num_prompt_tokens = len(request.prompt_token_ids)
    if num_prompt_tokens == 0:
        raise RequestRejected(request_id, "the prompt is empty")
    if num_prompt_tokens + sampling.max_tokens > config.max_model_len:
        raise RequestRejected(
            request_id,
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
            f"max_model_len ({config.max_model_len})",
        )
    num_seqs = sampling.num_completions
    if num_seqs > config.max_num_seqs:
        raise RequestRejected(request_id, f"{num_seqs} sequences exceed max_num_seqs ({config.max_num_seqs})")
    num_blocks = max_group_blocks(config, num_prompt_tokens, sampling.max_tokens, num_seqs,
                                  sampling.is_beam_search)
    if num_blocks > config.num_gpu_blocks:
        raise RequestRejected(
            request_id,
            f"needs up to {num_blocks} KV blocks, more than the {config.num_gpu_blocks} of the GPU pool",
        )

    stop_token_ids = frozenset(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop_token_ids |= frozenset(request.eos_token_ids)
    prompt = list(request.prompt_token_ids)
    continuations = _continuations_by_index(request)
    num_initial_seqs = 1 if sampling.is_beam_search else sampling.n
    seqs = []
    for index in range(num_initial_seqs):
        continuation = continuations.get(index)
        if continuation is None:
            seqs.append(Sequence(seq_id=next_seq_id(), output_index=index, token_ids=list(prompt),
                                 num_prompt_tokens=num_prompt_tokens))
        elif not continuation.is_finished:
            seqs.append(Sequence(seq_id=next_seq_id(), output_index=index,
                                 token_ids=prompt + continuation.token_ids, num_prompt_tokens=num_prompt_tokens,
                                 cumulative_logprob=continuation.cumulative_logprob))
    if request.adapter is not None:
        root = adapter_root_key(request.adapter.digest)
        for seq in seqs:
            seq.key_root = root
    group = SequenceGroup(request=request, arrival_index=arrival_index, seqs=seqs,
                          stop_token_ids=stop_token_ids, max_output_tokens=sampling.max_tokens,
                          priority=request.priority if config.is_priority_policy else 0)
    group.num_completions_done = num_initial_seqs - len(seqs)
    if sampling.is_beam_search:
        group.beam = BeamSearchState(beam_width=sampling.beam_width, length_penalty=sampling.length_penalty,
                                     max_new_tokens=sampling.max_tokens, stop_token_ids=stop_token_ids)
    group.plan_shared_prefix()
    return group


def _continuations_by_index(request: Request) -> dict[int, Continuation]:
    """The request's continuations by output index; raises RequestRejected when they could not
    come from a run of this request (beam search, an index out of range or repeated, more tokens
    than max_tokens allows, nothing left to continue)."""
    if not request.continuations:
        return {}
    request_id = request.request_id
    sampling = request.sampling
    if sampling.is_beam_search:
        raise RequestRejected(request_id, "beam search requests start over: they take no continuations")
    by_index: dict[int, Continuation] = {}
    for continuation in request.continuations:
        index = continuation.index
        if not 0 <= index < sampling.n:
            raise RequestRejected(request_id, f"continuation index {index} is outside the request's "
                                              f"{sampling.n} completions")
        if index in by_index:
            raise RequestRejected(request_id, f"continuation index {index} is given twice")
        if len(continuation.token_ids) > sampling.max_tokens or (
                not continuation.is_finished and len(continuation.token_ids) == sampling.max_tokens):
            raise RequestRejected(request_id, f"continuation {index} has {len(continuation.token_ids)} tokens: "
                                              f"more than an unfinished completion of max_tokens "
                                              f"({sampling.max_tokens}) can have")
        by_index[index] = continuation
    if len(by_index) == sampling.n and all(c.is_finished for c in by_index.values()):
        raise RequestRejected(request_id, "every completion has finished: nothing to continue")
    return by_index
