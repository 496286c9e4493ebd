"""Per-layer matmul time of weight-only int8/int4 against dense float32/bfloat16, by batch rows.

    python bench/quant_matmul.py [--threads N] [--layers 8] [--reps 15] [--rows 1,8,16,32,256]

One decoder layer of SmolLM2-135M (hidden 576, intermediate 1536, q 576, kv 192) is four
matmuls: qkv [960 x 576], o [576 x 576], gate_up [3072 x 576], down [576 x 1536]. Each row of the
table is the time of those four for M input rows (1, 8, 32: decode batches; 256: a prefill chunk),
with `--layers` copies of the weights visited in turn so they come from memory, not cache, as in a
30-layer forward. The best of `--reps` passes is kept (the machine may be shared). Activations
are float32, as in the model on CPU; the quantized paths convert them to bfloat16 themselves.

    fp32, bf16            F.linear on a dense weight (bf16: a bfloat16 copy of the weight, the
                          cost a quantized model would pay to keep one beside its codes)
    int8 kernel / deq     torch._weight_int8pack_mm / bfloat16 dequantize-then-matmul
    int4 kernel / deq     torch._weight_int4pack_mm_for_cpu / the same dequantize-then-matmul
    int8 auto, int4 auto  what pagedserve.kernels.ops.quantized_linear picks (the rule under test)

A table goes to stdout and JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from pagedserve.kernels import ops
from pagedserve.kernels.linear.quantized import (
    MAX_KERNEL_ROWS,
    int4_linear_dequant,
    int4_linear_packed_mm,
    int8_linear_dequant,
    int8_linear_packed_mm,
)
from pagedserve.worker.quantization.quantizers import quantize_int4, quantize_int8

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)


def build_layers(num_layers: int, group_size: int) -> list[dict]:
    layers = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(num_layers):
        layer = {}
        for name, (num_rows, num_cols) in SHAPES.items():
            weight = torch.randn(num_rows, num_cols, generator=generator) / num_cols ** 0.5
            layer[name] = {"fp32": weight, "bf16": weight.to(torch.bfloat16), "int8": quantize_int8(weight),
                           "int4": quantize_int4(weight, group_size), "num_cols": num_cols}
        layers.append(layer)
    return layers


METHODS = {
    "fp32": lambda x, w: F.linear(x, w["fp32"]),
    "bf16": lambda x, w: F.linear(x.to(torch.bfloat16), w["bf16"]).float(),
    "int8 kernel": lambda x, w: int8_linear_packed_mm(x, w["int8"]),
    "int8 deq": lambda x, w: int8_linear_dequant(x, w["int8"]),
    "int8 auto": lambda x, w: ops.quantized_linear(x, w["int8"]),
    "int4 kernel": lambda x, w: int4_linear_packed_mm(x, w["int4"]),
    "int4 deq": lambda x, w: int4_linear_dequant(x, w["int4"]),
    "int4 auto": lambda x, w: ops.quantized_linear(x, w["int4"]),
}


def time_layer(method, layers: list[dict], x: torch.Tensor) -> float:
    """Seconds for one pass over every layer copy, divided by the number of copies."""
    start = time.perf_counter()
    for layer in layers:
        for weights in layer.values():
            method(x[:, : weights["num_cols"]], weights)
    return (time.perf_counter() - start) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rows", default="1,8,16,32,64,128,256")
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = build_layers(args.layers, args.group_size)
    rows = []
    for num_rows in [int(value) for value in args.rows.split(",")]:
        x = torch.randn(num_rows, 1536, generator=torch.Generator().manual_seed(1))
        best = {name: float("inf") for name in METHODS}
        reps = max(2, args.reps // (4 if num_rows > 64 else 1))
        with torch.inference_mode():
            for name, method in METHODS.items():  # warm-up
                time_layer(method, layers[:1], x)
            for _ in range(reps):  # interleaved, so a noisy moment hits every method alike
                for name, method in METHODS.items():
                    best[name] = min(best[name], time_layer(method, layers, x))
        row = {"rows": num_rows, **{f"{name} ms": best[name] * 1e3 for name in METHODS}}
        row["int8 auto vs fp32"] = best["fp32"] / best["int8 auto"]
        row["int4 auto vs fp32"] = best["fp32"] / best["int4 auto"]
        row["int8 auto vs bf16"] = best["bf16"] / best["int8 auto"]
        row["int4 auto vs bf16"] = best["bf16"] / best["int4 auto"]
        rows.append(row)
        print(f"M={num_rows} done", flush=True)
    print_table(rows, title=f"ms per SmolLM2 decoder layer (4 matmuls), int4 group {args.group_size}, "
                            f"{torch.get_num_threads()} threads; auto = the packed kernel up to "
                            f"{MAX_KERNEL_ROWS['int8']} (int8) / {MAX_KERNEL_ROWS['int4']} (int4) rows",
                float_format=".3f")
    report = {"machine": machine("torch"), "threads": torch.get_num_threads(), "layers": args.layers,
              "group_size": args.group_size, "max_kernel_rows": MAX_KERNEL_ROWS, "rows": rows}
    for path in save_report(f"quant_matmul-{timestamp()}", report):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
