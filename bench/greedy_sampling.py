"""The sampler's greedy path on SmolLM2-sized logits: the native kernel (kernels/native/greedy.c)
against the torch ops it replaced (kernels/sampling/greedy.py greedy_ref), interleaved in one
process.

    python bench/greedy_sampling.py [--rows 1,8,32] [--vocab 49152] [--repeats 40] [--threads 2]

Logits are seeded normal values in bfloat16 and float32; medians in microseconds, warm (the same
logits again and again) and cold (64 MiB read between calls, as a decode step's forward streams the
weights through the caches before sampling). Tokens must be identical, log probabilities within
1e-5; the table says so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lib.machine_info import machine
from lib.output import print_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.kernels.sampling import greedy

    flush = torch.ones(16 * 2**20)  # 64 MiB
    rows_out = []
    for dtype in (torch.bfloat16, torch.float32):
        for num_rows in (int(value) for value in args.rows.split(",")):
            logits = (torch.randn(num_rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
            kernels = {"native": greedy.greedy_native, "torch": greedy.greedy_ref}
            times = {(name, cold): [] for name in kernels for cold in (False, True)}
            results = {}
            for repeat in range(args.repeats):
                for name in (kernels if repeat % 2 == 0 else list(reversed(kernels))):
                    for cold in (False, True):
                        if cold:
                            flush.add_(1.0)
                        started = time.perf_counter()
                        results[name] = kernels[name](logits)
                        times[(name, cold)].append(time.perf_counter() - started)
            ids_equal = results["native"][0] == results["torch"][0]
            max_diff = max(abs(a - b) for a, b in zip(results["native"][1], results["torch"][1]))
            row = {"dtype": str(dtype).removeprefix("torch."), "rows": num_rows}
            for (name, cold), samples in times.items():
                row[f"{name} {'cold' if cold else 'warm'} us"] = statistics.median(samples) * 1e6
            row["same tokens"] = ids_equal
            row["logprob max diff"] = f"{max_diff:.1e}"
            rows_out.append(row)
    print_table(rows_out, title=f"{machine('torch')['cpu']}, {args.threads} threads: greedy sampling, "
                                f"vocabulary {args.vocab} (medians of {args.repeats})", float_format=",.0f")


if __name__ == "__main__":
    main()
