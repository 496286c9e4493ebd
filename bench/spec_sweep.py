"""Speculative decoding against batch size: where does verifying proposals stop paying?

    python bench/spec_sweep.py [--model smollm2] [--batch-sizes 1,2,4,8,12,16,24,32] [--max-tokens 96]
                               [--k 4] [--method ngram] [--serve-args FLAG ...]

Two servers of the same model, started before the runs: speculation off, and `--method` with K
proposals per step and --speculative-disable-batch-size high enough that it speculates at every
batch size. For each batch size B, the 12 prompts of bench/lib/spec_workload.py (6 grounded, 6 chat,
interleaved) are sent B at a time, in ceil(12 / B) rounds (at least one), each round to both
servers in turn so both see the same machine load; greedy, chat template. Output tokens / summed
round time per server, and the ratio. The smallest B where the ratio falls below 1 is where
`--speculative-disable-batch-size` should cut speculation off for this model and machine.

A table goes to stdout; JSON and a PNG plot (tokens/s of both servers and the speed-up against
B) to bench/results/.
"""

from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ThreadPoolExecutor

from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from pagedserve.launch.serve_process import ServeProcess
from lib.spec_workload import CHAT, GROUNDED, chat_request, finish, serve, spec_counters
from lib.workload import RESULTS_DIR

PROMPTS = [prompt for pair in zip(GROUNDED, CHAT) for prompt in pair]  # grounded, chat, grounded, ...


def run_batch_size(servers: dict[str, ServeProcess], batch_size: int, max_tokens: int) -> dict[str, dict]:
    """ceil(12 / B) rounds of B concurrent requests (the prompts cycled), each round on every server in turn."""
    totals = {name: {"seconds": 0.0, "num_output_tokens": 0, "outputs": []} for name in servers}
    before = {name: spec_counters(server) for name, server in servers.items()}
    num_rounds = max(1, math.ceil(len(PROMPTS) / batch_size))
    for round_index in range(num_rounds):
        prompts = [PROMPTS[(round_index * batch_size + i) % len(PROMPTS)] for i in range(batch_size)]
        for name, server in servers.items():
            started = time.perf_counter()
            with ThreadPoolExecutor(batch_size) as pool:
                responses = list(pool.map(
                    lambda text: server.stub.Generate(chat_request(text, max_tokens), timeout=3600), prompts))
            totals[name]["seconds"] += time.perf_counter() - started
            totals[name]["num_output_tokens"] += sum(r.usage.completion_tokens for r in responses)
            totals[name]["outputs"] += [list(r.completions[0].token_ids) for r in responses]
    return {name: finish(totals[name], before[name], spec_counters(server), num_rounds * batch_size)
            for name, server in servers.items()}


def plot(rows: list[dict], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row["batch_size"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(sizes, [row["off_tokens_per_second"] for row in rows], "o-", label="speculation off")
    left.plot(sizes, [row["spec_tokens_per_second"] for row in rows], "s-", label="speculating at every batch size")
    left.set_xlabel("concurrent requests")
    left.set_ylabel("output tokens/s")
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [str(size) for size in sizes])
    left.legend()
    left.grid(alpha=0.3)
    right.plot(sizes, [row["speedup"] for row in rows], "o-", color="C2")
    right.axhline(1.0, color="grey", linewidth=1)
    right.set_xlabel("concurrent requests")
    right.set_ylabel("speed-up (speculating / off)")
    right.set_xscale("log", base=2)
    right.set_xticks(sizes, [str(size) for size in sizes])
    right.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,2,4,8,12,16,24,32")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="proposed tokens per step")
    parser.add_argument("--method", default="ngram", help="ngram or draft (then give --speculative-model in --serve-args)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="flags for both servers, e.g. --dtype float32 --quantization none")
    args = parser.parse_args()
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    spec_flags = ["--speculative-method", args.method, "--num-speculative-tokens", str(args.k),
                  "--speculative-disable-batch-size", "1024"]
    spec_name = f"{args.method} K={args.k}"
    off = serve(args, "sweep-off", [])
    servers = {"off": off}
    try:
        servers[spec_name] = serve(args, f"sweep-{args.method}", spec_flags)
        rows = []
        for batch_size in sizes:
            results = run_batch_size(servers, batch_size, args.max_tokens)
            base, spec = results["off"], results[spec_name]
            row = {"batch_size": batch_size, "num_requests": base["num_requests"],
                   "off_tokens_per_second": base["tokens_per_second"],
                   "spec_tokens_per_second": spec["tokens_per_second"],
                   "speedup": spec["tokens_per_second"] / base["tokens_per_second"],
                   "acceptance_rate": spec["acceptance_rate"], "mean_accepted_length": spec["mean_accepted_length"],
                   "is_same_output": spec["outputs"] == base["outputs"]}
            rows.append(row)
            print(row, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print_table(rows, ["batch_size", "num_requests", "off_tokens_per_second", "spec_tokens_per_second", "speedup",
                       "acceptance_rate", "mean_accepted_length", "is_same_output"],
                title=f"{spec_name} against speculation off, by batch size", float_format=",.2f")
    name = f"spec_sweep-{timestamp()}"
    plot(rows, RESULTS_DIR / f"{name}.png", f"{spec_name} on {args.model}, {args.max_tokens} tokens, greedy")
    save_report(name, {"machine": machine("torch"), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
