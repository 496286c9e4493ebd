"""This machine's limits: measured read bandwidth and GEMM peak per dtype, the denominators of
every "share of the limit" figure.

    python bench/roofline.py [--threads N] [--dtypes float32,bfloat16] [--gib 1.0]

    read bandwidth   a STREAM-like read: torch.sum over --gib of float32 (far more than any cache)
                     on 2 MiB pages where the host has them, best of repeats, in GB/s; decode of
                     few streams reads every weight once per token, so bandwidth / weight bytes
                     per token is the one-stream tok/s limit
    GEMM peak        F.linear on [rows, 2048] x [2048, 2048]^T at 1, 32 and 512 rows per dtype
                     (the weight fits the last-level cache: compute, not memory), best of repeats,
                     in GFLOP/s; peak at 32 rows / FLOPs per token is the 32-stream tok/s limit

`measure_matmul` times the benchmark model's own shapes (MFU of bench/real_model.py); its peak is
the best of these. The main program prints the limits and writes them, with the CPU model and the
load average, to bench/results/ and bench/results/kept/ (docs/performance-tables.md is made from
the kept ones: `make perf-tables`).
"""

from __future__ import annotations

import argparse
import os
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


GEMM_ROWS = (1, 32, 512)
GEMM_SIZE = 2048


class BandwidthProbe:
    """torch.sum over `gib` GiB of float32 (one read of every byte), torch's threads, on 2 MiB pages
    where the host gives them, as the worker keeps its weights (pagedserve/huge_pages.py; on AMD EPYC
    35.2 GB/s against 33.3 on 4 KiB pages). The buffer is kept, so that a benchmark can also take
    short samples between its requests: on a shared host the bandwidth changes within seconds
    (docs/cpu-limits.md), and a limit measured once at the start need not be what a later run met."""

    def __init__(self, gib: float = 1.0) -> None:
        from pagedserve.huge_pages import huge_page_buffer

        self._data = huge_page_buffer(int(gib * (1 << 30))).view(torch.float32).fill_(1.0)
        self._data.sum()
        self.samples: list[float] = []

    def best(self, seconds: float) -> float:
        """GB/s of the fastest pass within `seconds` (at least two passes)."""
        best, passes = float("inf"), 0
        deadline = time.perf_counter() + seconds
        while passes < 2 or time.perf_counter() < deadline:
            start = time.perf_counter()
            self._data.sum()
            best, passes = min(best, time.perf_counter() - start), passes + 1
        return self._data.numel() * 4 / best / 1e9

    def sample(self, seconds: float = 0.1) -> float:
        """A short measurement, also appended to `samples`."""
        self.samples.append(self.best(seconds))
        return self.samples[-1]


def measure_read_bandwidth(gib: float = 1.0, seconds: float = 3.0) -> float:
    """Best GB/s of BandwidthProbe's read over `seconds`."""
    return BandwidthProbe(gib).best(seconds)


def measure_gemm_peaks(dtype: torch.dtype, rows: tuple[int, ...] = GEMM_ROWS, seconds: float = 1.0) -> dict[int, float]:
    """{rows: best GFLOP/s of F.linear([rows, 2048] x [2048, 2048]^T)} in dtype."""
    return {num: time_linear(num, GEMM_SIZE, GEMM_SIZE, dtype, seconds) / 1e9 for num in rows}


def measure_limits(dtypes: list[str], gib: float = 1.0, probe: BandwidthProbe | None = None) -> dict:
    """{"read_gb_per_s", "gemm_gflops": {dtype: {rows: GFLOP/s}}, "num_threads"}; the bandwidth by
    `probe`'s buffer where one is given."""
    read = probe.best(3.0) if probe is not None else measure_read_bandwidth(gib)
    return {"num_threads": torch.get_num_threads(), "read_gb_per_s": read,
            "gemm_gflops": {dtype: {str(num): value for num, value in measure_gemm_peaks(getattr(torch, dtype)).items()}
                            for dtype in dtypes}}


def token_limits(limits: dict, weight_bytes: float, flops_per_token: float, dtype: str) -> dict:
    """tok/s limits: one stream from bandwidth (every weight read once per token), 32 streams from
    the GEMM peak at 32 rows (where the dtype has one)."""
    out = {"1": limits["read_gb_per_s"] * 1e9 / weight_bytes}
    peak = limits["gemm_gflops"].get(dtype, {}).get("32")
    if peak is not None:
        out["32"] = peak * 1e9 / flops_per_token
    return out


def main() -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lib.machine_info import machine
    from lib.output import save_report, timestamp
    from perf_tables import save_kept

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB read per bandwidth pass")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    limits = measure_limits(args.dtypes.split(","), args.gib)
    report = {"kind": "limits", "machine": machine("torch"), "date": timestamp(), "load_average_start": load_start,
              "load_average_end": os.getloadavg(), **limits}
    print(f"{report['machine']['cpu']}, {args.threads} threads, load average {load_start[0]:.2f}")
    print(f"read bandwidth: {limits['read_gb_per_s']:.1f} GB/s")
    for dtype, peaks in limits["gemm_gflops"].items():
        print(f"GEMM {dtype}: " + ", ".join(f"{rows} rows {value:.1f} GFLOP/s" for rows, value in peaks.items()))
    for path in save_report(f"limits-{report['date']}", report) + save_kept("limits", report):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
