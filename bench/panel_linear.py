"""SmolLM2-135M's projections of one step at 1-512 rows of x, through each bfloat16 path the worker
has: oneDNN's prepacked layout, the 16-column panels (kernels/linear/panels.py) and, at up to
eight rows, the native row kernel on the dense weight (kernels/linear/native_rows.py).

    python bench/panel_linear.py [--rows 1,2,4,8,16,32,64,128,512] [--threads 2] [--iters 15]

Random bfloat16 weights of SmolLM2's shapes for all 30 layers plus the LM head (268 MB, more than
the caches hold); per row count, the median ms of one pass over all 121 weights, the paths
interleaved, and each path's GFLOP/s (2 x rows x parameters / time). Which layout a host keeps is
decided at its first start by the much shorter measurement in kernels/native/tuning.py; this bench
shows the whole range. Run it with GOMP_SPINCOUNT=30000, as the worker runs. A table goes to
stdout, JSON (with the CPU model) to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("GOMP_SPINCOUNT", "30000")

import torch  # noqa: E402

from lib.machine_info import machine  # noqa: E402
from lib.output import print_table, save_report, timestamp  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down [out, in]
LM_HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.kernels.linear import panels
    from pagedserve.kernels.linear.native_rows import KERNEL_MAX_ROWS, linear_rows, supports
    from pagedserve.kernels.linear.onednn import prepack_linear_weight, prepacked_linear

    lib = panels.library()
    assert lib is not None, "the panel kernel is not available here (AVX-512 BF16)"
    weights = [torch.randn(shape).bfloat16() for _ in range(30) for shape in SHAPES] + [
        torch.randn(LM_HEAD).bfloat16()]
    onednn_weights = [prepack_linear_weight(weight) for weight in weights]
    panel_weights = [panels.pack(weight) for weight in weights]
    flop_per_row = 2 * sum(weight.numel() for weight in weights)
    rows_out = []
    for num_rows in (int(value) for value in args.rows.split(",")):
        inputs = {size: torch.randn(num_rows, size).bfloat16() for size in (576, 1536)}
        paths = {
            "onednn": lambda: [prepacked_linear(inputs[w.shape[1]], p, None) for w, p in zip(weights, onednn_weights)],
            "panels": lambda: [panels.panel_linear(inputs[p.in_features], p, None, lib) for p in panel_weights],
        }
        if supports(inputs[576], weights[0], KERNEL_MAX_ROWS):
            paths["rows"] = lambda: [linear_rows(inputs[w.shape[1]], w, None) for w in weights]
        times = {name: [] for name in paths}
        for run in paths.values():
            run()
        for _ in range(args.iters if num_rows <= 64 else max(3, args.iters // 3)):
            for name, run in paths.items():
                started = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - started) * 1e3)
        row = {"rows": num_rows}
        for name, values in times.items():
            row[f"{name}_ms"] = statistics.median(values)
            row[f"{name}_gflops"] = flop_per_row * num_rows / row[f"{name}_ms"] / 1e6
        row["panels_vs_onednn"] = row["onednn_ms"] / row["panels_ms"]
        rows_out.append(row)
        print(f"  {num_rows} rows done", flush=True)
    columns = ["rows", "onednn_ms", "panels_ms", "rows_ms", "panels_vs_onednn", "onednn_gflops", "panels_gflops"]
    print_table(rows_out, columns, title=f"121 SmolLM2 projections, ms per pass ({args.threads} threads)",
                float_format=",.2f")
    report = {"machine": machine("torch"), "threads": args.threads, "rows": rows_out}
    print(f"wrote {save_report(f'panel_linear-{timestamp()}', report)[0]}")


if __name__ == "__main__":
    main()
