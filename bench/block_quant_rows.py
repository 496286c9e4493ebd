"""The projections of one SmolLM2-135M decode step at 1-32 rows, with GGUF Q4_1 / Q8_0 blocks kept
(the native block kernel, pagedserve.kernels.linear.block_quant) against bfloat16 (the native row
kernel up to 8 rows, oneDNN/F.linear above) and PyTorch's int4 kernel (--quantization int4).

    python bench/block_quant_rows.py [--rows 1,4,8,32] [--threads 2] [--iters 10]

Random weights of SmolLM2's 120 layer projections (30 layers: qkv, o, gate_up, down; the LM head
stays in the file's type and is left out), more than the caches hold, so each pass streams them
from memory as a real step does. Per row count and format: the median ms of one pass over all of
them, the bytes read per pass / that time (GB/s), and, given --read-gbps (bench/roofline.py's
read bandwidth, measured in the same run by default), the share of it. Run it with
GOMP_SPINCOUNT=30000, as the worker runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from perf_tables import save_kept
from roofline import measure_read_bandwidth

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down [out, in]


def block_weights(bits: int) -> list:
    from pagedserve.kernels.linear.block_quant import BlockQuantWeight

    out = []
    for _ in range(30):
        for rows, cols in SHAPES:
            codes = torch.randint(0, 16, (rows, cols)) if bits == 4 else torch.randint(-127, 128, (rows, cols))
            scales = (torch.rand(rows, cols // 32) * 0.01).half()
            mins = (-torch.rand(rows, cols // 32) * 0.05).half() if bits == 4 else None
            out.append(BlockQuantWeight.from_codes(codes, scales.float(), None if mins is None else mins.float(), bits))
    return out


def nbytes(weight) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in weight.tensors().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--read-gbps", type=float, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.kernels import ops
    from pagedserve.kernels.linear import native_rows
    from pagedserve.worker.quantization.quantizers import quantize_int4

    load_start = os.getloadavg()
    read_gbps = args.read_gbps or measure_read_bandwidth(1.0)
    dense = [torch.randn(shape).bfloat16() for _ in range(30) for shape in SHAPES]
    formats = {"bf16": (dense, sum(w.numel() * 2 for w in dense)),
               "q4_1 blocks": (q4 := block_weights(4), sum(map(nbytes, q4))),
               "q8_0 blocks": (q8 := block_weights(8), sum(map(nbytes, q8))),
               "int4 g32 (torch)": (i4 := [quantize_int4(w.float(), 32) for w in dense],
                                    sum(map(nbytes, i4)))}
    lib = native_rows.library()
    results = []
    for num_rows in (int(value) for value in args.rows.split(",")):
        inputs = {size: torch.randn(num_rows, size).bfloat16() for size in (576, 1536)}

        def run(name: str, weights: list) -> None:
            for weight in weights:
                x = inputs[weight.in_features if not isinstance(weight, torch.Tensor) else weight.shape[1]]
                if name != "bf16":
                    ops.quantized_linear(x, weight)
                elif lib is not None and num_rows <= native_rows.KERNEL_MAX_ROWS:
                    native_rows.linear_rows(x, weight, None, lib)
                else:
                    F.linear(x, weight)

        times: dict[str, list[float]] = {name: [] for name in formats}
        for name, (weights, _) in formats.items():
            run(name, weights)
        for _ in range(args.iters):  # interleaved: every format sees the same machine load
            for name, (weights, _) in formats.items():
                started = time.perf_counter()
                run(name, weights)
                times[name].append(time.perf_counter() - started)
        for name, (_, num_bytes) in formats.items():
            seconds = statistics.median(times[name])
            results.append({"rows": num_rows, "format": name, "ms": seconds * 1e3, "MB read": num_bytes / 1e6,
                            "GB/s": num_bytes / seconds / 1e9, "% of read bandwidth": 100 * num_bytes / seconds / 1e9 / read_gbps})
    report = {"machine": machine("torch"), "threads": args.threads, "read_gb_per_s": read_gbps,
              "load_average_start": load_start, "load_average_end": os.getloadavg(), "rows": results}
    print_table(results, title=f"{report['machine']['cpu']}, {args.threads} threads, read bandwidth {read_gbps:.1f} GB/s, "
                               f"load average {load_start[0]:.2f}: 120 SmolLM2 projections per pass")
    report["date"] = timestamp()
    for path in save_report(f"block_quant_rows-{report['date']}", report) + save_kept("block_quant_rows", report):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
