"""Greedy selection of logits rows: per row the first index of its largest value and that token's
log probability, max - logsumexp(row) = -log(sum(exp(row - max))).

    greedy_native   the native kernel (kernels/native/greedy.c): one C call for the batch, rows over
                    the threads; the index equals the reference's, the log probability differs in
                    the last bits (another exp of the same accuracy, sums in another order)
    greedy_ref      the torch ops (the reference): ROWS_PER_PASS rows at a time, whose float32 copy
                    and exponentials (4 x 49,152 floats, 0.8 MB) stay in the core's cache between
                    the ops; max(dim) returns the first maximal index as argmax does, at a third of
                    argmax's cost

A decode step's sampling took 0.19-0.34 ms at one row through the torch ops (about ten ops, each
run with the caches cold after the forward streamed the weights).
"""

from __future__ import annotations

from functools import partial

import torch

from pagedserve.kernels.native import library as native_lib
from pagedserve.kernels.native.abi import DTYPE_CODES

ROWS_PER_PASS = 4


def supports(logits: torch.Tensor):
    """The native library for logits [rows, vocab] in float32 or bfloat16 on the CPU whose last
    dimension is contiguous, else None."""
    if not (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in DTYPE_CODES
            and logits.stride(-1) == 1 and logits.shape[0] > 0):
        return None
    return native_lib.load()


def greedy_native(logits: torch.Tensor, lib=None) -> tuple[list[int], list[float]]:
    lib = lib or native_lib.load()
    rows, vocab = logits.shape
    ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    lib.greedy_rows(logits.data_ptr(), rows, vocab, logits.stride(0), DTYPE_CODES[logits.dtype], ids.data_ptr(),
                    logprobs.data_ptr())
    return ids.tolist(), logprobs.tolist()


class BoundGreedy:
    """greedy_native(logits) as a call without arguments, bound to logits [rows, vocab] (supports(logits)
    holds; the caller keeps it and changes only its values), its outputs allocated once: the same
    kernel call, at none of the per-call checks and allocations."""

    def __init__(self, logits: torch.Tensor, lib) -> None:
        rows, vocab = logits.shape
        self.ids = torch.empty(rows, dtype=torch.int64)
        self.logprobs = torch.empty(rows, dtype=torch.float32)
        self.logits, self.lib = logits, lib
        self._ids, self._logprobs = self.ids.numpy(), self.logprobs.numpy()
        self._call = partial(lib.greedy_rows, logits.data_ptr(), rows, vocab, logits.stride(0),
                             DTYPE_CODES[logits.dtype], self.ids.data_ptr(), self.logprobs.data_ptr())

    def __call__(self) -> tuple[list[int], list[float]]:
        self._call()
        return self._ids.tolist(), self._logprobs.tolist()  # numpy's tolist: the same values, for less


def greedy_ref(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    chosen_ids: list[int] = []
    chosen_logprobs: list[float] = []
    for start in range(0, logits.shape[0], ROWS_PER_PASS):
        raw = logits[start:start + ROWS_PER_PASS].float()  # [k, V]
        maxima, chosen = raw.max(dim=-1)  # [k] each
        chosen_ids += chosen.tolist()
        chosen_logprobs += (raw - maxima[:, None]).exp_().sum(dim=-1).log_().neg_().tolist()  # [k]
    return chosen_ids, chosen_logprobs
