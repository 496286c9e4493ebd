"""This machine's matrix-multiply throughput, the denominator of model FLOP utilization.

Times torch.nn.functional.linear (what every projection of the model runs) on the benchmark
model's own weight shapes with many rows, and on a square 2048^3 product, in the dtype and with
the torch thread count of the run. The peak is the best of these: MFU against it is
conservative.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lib.workload import ModelShape


def matmul_shapes(shape: ModelShape, num_rows: int) -> list[tuple[int, int, int]]:
    """(rows, in, out) of the model's projections, and a square product."""
    q_size = shape.num_heads * shape.head_size
    qkv = q_size + 2 * shape.num_kv_heads * shape.head_size
    return [(num_rows, shape.hidden_size, qkv), (num_rows, q_size, shape.hidden_size),
            (num_rows, shape.hidden_size, 2 * shape.intermediate_size),
            (num_rows, shape.intermediate_size, shape.hidden_size),
            (num_rows, shape.hidden_size, shape.vocab_size), (2048, 2048, 2048)]


def time_linear(rows: int, inner: int, outer: int, dtype: torch.dtype, seconds: float) -> float:
    """Best FLOP/s of F.linear([rows, inner] x [outer, inner]^T) over repeats for `seconds`."""
    x = torch.randn(rows, inner, dtype=dtype)
    weight = torch.randn(outer, inner, dtype=dtype)
    F.linear(x, weight)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        F.linear(x, weight)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return 2.0 * rows * inner * outer / best


def measure_matmul(shape: ModelShape, dtype: torch.dtype, *, num_rows: int = 512,
                   seconds_per_shape: float = 1.0) -> dict:
    """{"shapes": [{rows, in, out, gflops}], "peak_gflops"} for dtype with torch's current threads."""
    rows = []
    for num, inner, outer in matmul_shapes(shape, num_rows):
        flops = time_linear(num, inner, outer, dtype, seconds_per_shape)
        rows.append({"rows": num, "in": inner, "out": outer, "gflops": flops / 1e9})
    return {"dtype": str(dtype).removeprefix("torch."), "num_threads": torch.get_num_threads(),
            "shapes": rows, "peak_gflops": max(row["gflops"] for row in rows)}
