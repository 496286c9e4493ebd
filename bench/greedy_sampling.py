"""The sampler's greedy path on SmolLM2-sized logits: all rows in one pass against
GREEDY_ROWS_PER_PASS rows at a time (pagedserve.worker.sampler), interleaved in one process.

    python bench/greedy_sampling.py [--rows 1,32] [--vocab 49152] [--repeats 40] [--threads 2]

Logits are seeded normal values in bfloat16 and float32; medians in microseconds. Both settings
run the same ops per row, so their tokens and logprobs are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lib.output import print_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.worker import sampler as sampler_module

    default = sampler_module.GREEDY_ROWS_PER_PASS
    rows_out = []
    for dtype in (torch.bfloat16, torch.float32):
        for num_rows in (int(value) for value in args.rows.split(",")):
            logits = (torch.randn(num_rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
            seq_ids = list(range(num_rows))
            settings = {"one_pass": num_rows, "per_pass": default}
            times: dict[str, list[float]] = {name: [] for name in settings}
            results = {}
            for repeat in range(args.repeats):
                order = list(settings) if repeat % 2 == 0 else list(reversed(settings))
                for name in order:
                    sampler_module.GREEDY_ROWS_PER_PASS = settings[name]
                    started = time.perf_counter()
                    results[name] = sampler_module.Sampler._sample_greedy(logits, seq_ids)
                    times[name].append(time.perf_counter() - started)
            sampler_module.GREEDY_ROWS_PER_PASS = default
            rows_out.append({"dtype": str(dtype).removeprefix("torch."), "rows": num_rows,
                             "one_pass_us": statistics.median(times["one_pass"]) * 1e6,
                             f"{default}_rows_per_pass_us": statistics.median(times["per_pass"]) * 1e6,
                             "identical": results["one_pass"] == results["per_pass"]})
    print_table(rows_out, title=f"greedy sampling, vocabulary {args.vocab} (medians of {args.repeats})",
                float_format=",.0f")


if __name__ == "__main__":
    main()
