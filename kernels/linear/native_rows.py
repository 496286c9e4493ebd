"""bfloat16 linear layers for a few rows (decoding few sequences) on the CPU: a native kernel that
streams the dense weight once (kernels/native/linear_rows.c); reference F.linear.

oneDNN (linear/onednn.py) is the better path for many rows, where AMX tiles pay off; with
few rows a step is a pass over every weight and the question is only how fast it streams. Each
thread reads one contiguous range of weight rows front to back, a single stream the hardware
prefetchers follow (a software prefetch distance is measured per host: kernels/native/tuning.py),
then takes what is left of another thread's range from its back (kernels/native/work_share.h).
It is ahead of oneDNN at one and two rows and about even at three or four (bench/linear_rows.py
times SmolLM2's projections of one decode step, whose weights are read once, from memory;
docs/kernels.md has the figures), so layers called one by one take it up to MAX_ROWS rows (two)
and oneDNN above; the native
decoder layers (pagedserve.worker.models.llama_native) take it up to four rows, where the calls
they save outweigh the rest.

The sums run in another order than oneDNN's, so results differ from F.linear in the last bit of
some values (float32 accumulation both). A float32 twin (linear_rows_f32, AVX-512 FMAs) serves
the native decoder layers (pagedserve.worker.models.llama_native); float32 layers called one by
one keep F.linear.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from pagedserve.kernels.native import library as native_lib

KERNEL_MAX_ROWS = 8  # the C kernel's LINEAR_ROWS_MAX
MAX_ROWS = 2  # where it beats oneDNN (above)


def supports(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS):
    """x [M, K] with 1 <= M <= max_rows, weight [N, K]: bfloat16, contiguous, on the CPU, and the CPU
    has AVX-512 BF16 -> the native library (pass it to linear_rows), else None."""
    if not (x.dtype == torch.bfloat16 and 0 < x.shape[0] <= max_rows and x.dim() == 2 and x.device.type == "cpu"
            and x.is_contiguous() and weight.dtype == torch.bfloat16 and weight.is_contiguous()):
        return None
    return library()


def library():
    """The native library where it has the row kernels (AVX-512 BF16), else None."""
    lib = native_lib.load()
    return lib if lib is not None and native_lib.has_kernel(lib, "linear_rows") else None


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lib=None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] -> [M, N] (callers check supports first)."""
    num_rows, size_in = x.shape
    y = torch.empty(num_rows, weight.shape[0], dtype=x.dtype)
    (lib or native_lib.load()).linear_rows_bf16(x.data_ptr(), weight.data_ptr(),
                                                bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                                num_rows, weight.shape[0], size_in)
    return y


def bound_linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, lib):
    """linear_rows(x, weight, bias) written into out [M, N] (x's dtype, contiguous) as a call without
    arguments, bound to these tensors (supports(x, weight) holds; the caller keeps them alive and
    changes only their values)."""
    return partial(lib.linear_rows_bf16, x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                   out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])


def linear_rows_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)
