"""Kernel tests run the Triton kernels compiled on CUDA when present, else on CPU through the
Triton interpreter in a child process (see triton_interpreter_process.py for why a child): the
test process itself never sets TRITON_INTERPRET, so other test folders are unaffected.

Tests call kernels as `kernels.call("pagedserve.kernels.<module>:<function>", *args)` and compute
the reference in the test process; `interpreter.call` always runs in the interpreter process
(used for the sparse 4 GiB pools of kernel_sparse_pool.py, which only exist on the CPU).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def _load_runner_module():
    path = Path(__file__).with_name("triton_interpreter_process.py")
    spec = importlib.util.spec_from_file_location("pagedserve_tests_triton_interpreter_process", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def interpreter() -> Iterator:
    """The Triton interpreter in a child process, on every machine (CPU tensors only)."""
    process = _load_runner_module().InterpreterProcess()
    yield process
    process.close()


@pytest.fixture(scope="session")
def kernels(request):
    """Where kernel tests run: compiled in this process on CUDA, else the interpreter process."""
    if HAS_CUDA:
        return _load_runner_module().InProcess()
    return request.getfixturevalue("interpreter")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


TOLERANCES = {  # (atol, rtol) against the fp32-accumulating reference
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass
class PagedBatch:
    """Inputs of one paged attention call, laid out as the worker lays them out."""

    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)


def build_paged_batch(
    seqs: list[tuple[int, int]],  # (cached context tokens, new query tokens) per sequence
    *, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
    device: torch.device, num_blocks: int | None = None, min_block_id: int = 0, seed: int = 0,
) -> PagedBatch:
    """Random K/V in randomly chosen blocks of a pool whose unused slots all hold NaN.

    A kernel that reads any slot outside a sequence's context (a padded table entry, the unused
    tail of a last block, another sequence's block) turns its output into NaN. Padded table
    entries point at real but foreign blocks for the same reason.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_used = sum(blocks_per_seq)
    num_blocks = num_blocks or min_block_id + num_used + 4
    if min_block_id + num_used > num_blocks:
        raise ValueError("pool too small for the batch")
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)  # [num_blocks, bs, kvh, hs]
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    ids = min_block_id + torch.randperm(num_blocks - min_block_id, generator=gen)[:num_used]  # [num_used]
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.randint(0, num_blocks, (len(seqs), max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for i, ((ctx, q), n) in enumerate(zip(seqs, blocks_per_seq)):
        block_tables[i, :n] = ids[used:used + n]
        used += n
        positions = torch.arange(ctx + q)  # [seq_len]
        blocks = block_tables[i, positions // block_size].long().to(device)  # [seq_len]
        slots = (positions % block_size).to(device)  # [seq_len]
        kv_shape = (ctx + q, num_kv_heads, head_size)
        key_cache[blocks, slots] = torch.randn(kv_shape, generator=gen).to(device=device, dtype=dtype)
        value_cache[blocks, slots] = torch.randn(kv_shape, generator=gen).to(device=device, dtype=dtype)
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)  # [num_seqs]
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)  # [num_seqs + 1]
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(q_lens.sum()), num_heads, head_size, generator=gen).to(dtype)  # [T, nh, hs]
    seq_lens = torch.tensor([ctx + q for ctx, q in seqs], dtype=torch.int32)  # [num_seqs]
    return PagedBatch(query.to(device), key_cache, value_cache, block_tables.to(device), seq_lens.to(device),
                      query_start_loc.to(device))


@pytest.fixture
def paged_batch(device) -> Callable[..., PagedBatch]:
    def make(seqs, **kwargs) -> PagedBatch:
        return build_paged_batch(seqs, device=device, **kwargs)
    return make


@pytest.fixture
def assert_matches() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """assert_close with the tolerance of the expected tensor's dtype; also rejects any NaN."""
    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        atol, rtol = TOLERANCES[expected.dtype]
        assert not actual.isnan().any(), "kernel output holds NaN: it read a slot outside the context"
        torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=atol, rtol=rtol)
    return check
