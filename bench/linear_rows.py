"""The projections of one SmolLM2-135M decode step at few rows: oneDNN (prepacked, the default for
bfloat16 before this kernel) against the native row kernel (pagedserve.kernels.linear.native_rows).

    python bench/linear_rows.py [--rows 1,2,3,4,6,8] [--threads 2] [--iters 20]

Random bfloat16 weights of SmolLM2's shapes for all 30 layers plus the LM head (268 MB, more than
the caches hold, so each step streams them from memory as a real step does); per row count, the
median ms of one pass over all 121 weights. Run it with GOMP_SPINCOUNT=30000, as the worker runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lib.output import print_table, save_report, timestamp

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down [out, in]
LM_HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.kernels.linear.native_rows import KERNEL_MAX_ROWS, linear_rows, supports
    from pagedserve.kernels.linear.onednn import prepack_linear_weight, prepacked_linear

    weights = [torch.randn(shape).bfloat16() for _ in range(30) for shape in SHAPES] + [
        torch.randn(LM_HEAD).bfloat16()]
    packed = [prepack_linear_weight(weight) for weight in weights]
    rows_out = []
    for num_rows in (int(value) for value in args.rows.split(",")):
        inputs = {size: torch.randn(num_rows, size).bfloat16() for size in (576, 1536)}
        assert supports(inputs[576], weights[0], KERNEL_MAX_ROWS), "the native kernel is not available here"

        def onednn() -> None:
            for weight in packed:
                prepacked_linear(inputs[weight.size(1)] if weight.dim() == 2 else inputs[576], weight, None)

        def native() -> None:
            for weight in weights:
                linear_rows(inputs[weight.shape[1]], weight, None)

        times = {"onednn": [], "native": []}
        for _ in range(3):
            onednn(), native()
        for _ in range(args.iters):
            for name, run in (("onednn", onednn), ("native", native)):
                started = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - started) * 1e3)
        row = {"rows": num_rows, **{f"{name}_ms": statistics.median(values) for name, values in times.items()}}
        row["speedup"] = row["onednn_ms"] / row["native_ms"]
        rows_out.append(row)
        print(f"  {num_rows} rows done", flush=True)
    print_table(rows_out, ["rows", "onednn_ms", "native_ms", "speedup"],
                title=f"121 SmolLM2 projections, ms per pass ({args.threads} threads)", float_format=",.2f")
    print(f"wrote {save_report(f'linear_rows-{timestamp()}', {'threads': args.threads, 'rows': rows_out})[0]}")


if __name__ == "__main__":
    main()
