"""Structured output on the worker: the scheduler's token bitmasks and the requests' logit_bias
applied to the logits rows before the sampler sees them.

    logits [rows, V] --bitmask rows: cleared bit -> -inf--> --logit_bias: += bias--> sampler

Everything after it (penalties, temperature, top-k/p, min-p, the draw, speculative verification,
reported logprobs) works on these logits, so a constrained row samples from the renormalised
constrained distribution and its logprobs are those of that distribution. A token a mask bans
stays banned whatever its bias (-inf + bias is -inf).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.contracts.step_plan import SampleSpec


def has_constraints(mask_row_indices: list[int], specs: list[SampleSpec]) -> bool:
    return bool(mask_row_indices) or any(spec.logit_bias for spec in specs)


def apply_constraints(logits: torch.Tensor, mask_row_indices: list[int], token_bitmasks: bytes,
                      specs: list[SampleSpec]) -> torch.Tensor:
    """logits [rows, V] -> float32 logits [rows, V] with masks and biases applied (logits itself
    when no row has either)."""
    if not has_constraints(mask_row_indices, specs):
        return logits
    logits = logits.to(torch.float32, copy=True)  # [rows, V]
    num_rows, vocab_size = logits.shape
    if mask_row_indices:
        banned = unpack_banned(token_bitmasks, len(mask_row_indices), vocab_size).to(logits.device)  # [masked, V]
        for index, row in enumerate(mask_row_indices):
            logits[row].masked_fill_(banned[index], float("-inf"))
    for row, spec in enumerate(specs):
        if spec.logit_bias:
            ids = torch.tensor(list(spec.logit_bias.keys()), device=logits.device)
            values = torch.tensor(list(spec.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row].index_add_(0, ids, values)
    return logits


def unpack_banned(token_bitmasks: bytes, num_rows: int, vocab_size: int) -> torch.Tensor:
    """Concatenated rows of little-endian int32 words -> bool [num_rows, vocab_size], True where
    the token is NOT allowed (a cleared bit); ids past the rows' width are banned."""
    words = np.frombuffer(token_bitmasks, dtype=np.uint8).reshape(num_rows, -1)  # [rows, 4 * words]
    bits = np.unpackbits(np.invert(words), axis=1, bitorder="little")  # [rows, 32 * words]
    if bits.shape[1] < vocab_size:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])), constant_values=1)
    return torch.from_numpy(np.ascontiguousarray(bits[:, :vocab_size]).view(np.bool_))
