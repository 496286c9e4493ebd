"""A decode run's later steps in one native call (kernels/native/decode_run.c): the kernels a run's
step calls from Python (the bound decode step, LM head and greedy kernel, worker/decode_run.py),
called one step after another in C, each step feeding the tokens the one before sampled one
position on. Its reference is that Python loop (DecodeRun's steps one by one), on the same buffers:
tests/worker/test_decode_run.py compares them bit for bit.

    steps = DecodeRunSteps.bind(lib, layers_call, head_call, greedy, row_arrays, table_lens, block_size, limit)
    ids, logprobs, seconds = steps.run(fed, num_steps, end_token_ids, poll)  # seconds: each step's forward

bind gives None where the calls are not the ones decode_run.c makes (the caller then steps in Python).

Between the steps of a run the worker's Python ran with the CPU caches just flushed by the
weights, about 0.2 ms a step at one sequence of SmolLM2 through `serve` on a 2-core AMD EPYC; the
loop in C runs none of it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pagedserve.kernels.native.abi import DTYPE_CODES, DecodeRun, StepRows

# decode_run.c's head_kind: bfloat16 logits (0-2), float32 logits (3)
HEAD_KINDS = {"panel_linear_bf16": 0, "linear_rows_bf16": 1, "block_quant_rows_bf16": 2, "block_quant_rows": 3}


def _head_fields(head) -> dict | None:
    """decode_run's LM head fields of a bound head call (ParallelLMHead.bound_forward: a bound kernel,
    block_quant.bound_block_quant_linear's call whose float32 output is rounded into the logits, or
    its call straight into float32 logits), or None for a call decode_run.c does not make."""
    rounds_into = getattr(head, "rounds_into", None)
    call = rounds_into[0] if rounds_into is not None else head
    kind = HEAD_KINDS.get(getattr(getattr(call, "func", None), "__name__", ""))
    if kind is None or (kind == 2) != (rounds_into is not None):
        return None
    args = call.args
    if kind == 3:  # (x, qs, d, m, y, M, N, K, bits): y the float32 logits
        return dict(head_kind=kind, head_weight=args[1], head_scales=args[2], head_mins=args[3], logits=args[4],
                    head_out=args[6], head_in=args[7], head_bits=args[8], logits_dtype=DTYPE_CODES[torch.float32])
    bf16 = DTYPE_CODES[torch.bfloat16]
    if kind == 2:  # (x, qs, d, m, y float32, M, N, K, bits), then y rounded into the logits
        return dict(head_kind=kind, head_weight=args[1], head_scales=args[2], head_mins=args[3], head_out32=args[4],
                    logits=rounds_into[1].data_ptr(), head_out=args[6], head_in=args[7], head_bits=args[8],
                    logits_dtype=bf16)
    # (x, weight or panels, bias, y, M, N, K)
    return dict(head_kind=kind, head_weight=args[1], head_bias=args[2], logits=args[3], head_out=args[5],
                head_in=args[6], logits_dtype=bf16)


class DecodeRunSteps:
    """decode_run_steps over a decode run's kept buffers (module doc). Its inputs and outputs are
    kept between calls and written and read through memoryviews: the call comes right after the
    weights have flushed the CPU caches, where numpy's conversions cost tens of microseconds each."""

    def __init__(self, lib, run: DecodeRun, num_rows: int, kept: tuple) -> None:
        self._lib, self._run, self._kept = lib, run, kept
        self._address = ctypes.addressof(run)
        self.num_rows = num_rows
        self._fed = np.zeros(num_rows, dtype=np.int64)
        self._fed_view, self._fed_address = memoryview(self._fed), self._fed.ctypes.data
        self._end_tokens: list[int] | None = None  # those run.end_tokens points to
        self._poll: tuple[int, int] | None = None
        self._capacity = 0
        self._grow(1)

    def _grow(self, num_steps: int) -> None:
        self._capacity = num_steps
        self._outputs = (np.zeros(num_steps * self.num_rows, dtype=np.int64),
                         np.zeros(num_steps * self.num_rows, dtype=np.float32), np.zeros(num_steps, dtype=np.int64))
        self._views = [memoryview(array) for array in self._outputs]
        self._addresses = [array.ctypes.data for array in self._outputs]

    @classmethod
    def bind(cls, lib, layers_call, head, greedy, rows: tuple[np.ndarray, ...], table_lens: np.ndarray,
             block_size: int, limit: int) -> "DecodeRunSteps | None":
        """The steps over these bound calls: layers_call (DecodeLayers.bound_step: decode_step's
        arguments in .args), head (the LM head's bound call), greedy (BoundGreedy over the head's
        logits, bfloat16 or float32); rows (positions, slots, lengths, block tables), the arrays the step's rows
        point to, which the steps write as set_rows does; table_lens [rows] int64, the blocks each row
        holds (the caller keeps it current); limit the rotary table's length. None where decode_run.c
        does not make these calls or the step reads other arrays."""
        fields = _head_fields(head) if head is not None and greedy is not None else None
        (layers, num_layers, step_rows, token_ids, embedding, vocab, final_norm, eps, residual, hidden, spare,
         scratch) = layers_call.args
        kept_rows = StepRows.from_address(step_rows)
        if (fields is None or DTYPE_CODES.get(greedy.logits.dtype) != fields["logits_dtype"]
                or greedy.logits.data_ptr() != fields["logits"]
                or greedy.logits.shape[0] != table_lens.shape[0] or kept_rows.num_rows != table_lens.shape[0]
                or [kept_rows.positions, kept_rows.slot_mapping, kept_rows.seq_lens, kept_rows.block_tables]
                != [array.ctypes.data for array in rows]):
            return None
        rows, vocab_size = greedy.logits.shape
        run = DecodeRun(layers=ctypes.addressof(layers), rows=step_rows, token_ids=token_ids, embedding=embedding,
                        final_norm=final_norm, residual=residual, hidden=hidden, spare=spare, scratch=scratch,
                        table_lens=table_lens.ctypes.data, ids=greedy.ids.data_ptr(),
                        logprobs=greedy.logprobs.data_ptr(), num_layers=num_layers, vocab=vocab,
                        logits_vocab=vocab_size, logits_stride=greedy.logits.stride(0), block_size=block_size,
                        limit=limit, eps=eps, **fields)
        return cls(lib, run, rows, (layers_call, head, greedy, table_lens))

    def run(self, fed: list[int], num_steps: int, end_token_ids: list[int],
            poll: tuple[int, int] | None = None) -> tuple[list[int], list[float], list[float]]:
        """Up to num_steps steps, the first feeding `fed` (a token per row): (ids, logprobs) of every
        step computed, row after row and step after step, and each step's forward seconds. It stops
        before a step when poll (a zmq_poll-like function's address and its item's) says a message
        waits, when a token fed is one of end_token_ids, when a row's next position is outside its
        blocks or the rotary table, and after a token outside the embedding table (that step computes
        nothing)."""
        if num_steps > self._capacity:
            self._grow(num_steps)
        run = self._run
        if end_token_ids != self._end_tokens:
            self._end_tokens = list(end_token_ids)
            self._end_array = np.array(self._end_tokens, dtype=np.int64)
            run.end_tokens, run.num_end_tokens = self._end_array.ctypes.data, len(self._end_tokens)
        if poll != self._poll:
            self._poll = poll
            run.poll, run.poll_item = poll if poll is not None else (None, None)
        view = self._fed_view
        for row, token in enumerate(fed):
            view[row] = token
        ids, logprobs, nanoseconds = self._addresses
        count = self._lib.decode_run_steps(self._address, self._fed_address, num_steps, ids, logprobs, nanoseconds)
        size = count * self.num_rows
        ids, logprobs, nanoseconds = self._views
        return ids[:size].tolist(), logprobs[:size].tolist(), [ns / 1e9 for ns in nanoseconds[:count].tolist()]
