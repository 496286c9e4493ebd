"""KV-cache memory: blocks saved by sharing, memory waste, and swap versus recompute, in one run.

    python bench/kv_memory.py [--parts sharing,waste,swap] [--repeats 5] [--lengths 64,256,1024,2048]
                           [--num-requests 256] [--seed 0] [--threads 1]

sharing  The real Scheduler with a deterministic fake worker (bench/lib/memory_sim.py), block size 16,
         prefix caching off. Two fixed batches of 8 requests, each run once per request kind
         (parallel sampling n = 2/4/8, beam search with width 2/4/8):
             long prompts    prompts of 37, 101, ..., 485 tokens, outputs of 128 and 256 in turn
             short prompts   prompts of 9, 13, ..., 37 tokens, outputs of 64 and 128 in turn
                             (near the Alpaca traces of the PagedAttention paper)
         At every step: distinct physical blocks the requests hold
         (Scheduler.num_blocks_of_request) versus the sum over their sequences of ceil(len / 16),
         i.e. every sequence holding its own copy of its history; and what sharing only the
         prompt's full blocks would save.
waste    The same scheduler over a seeded mixed workload (--num-requests requests arriving as a
         Poisson process of 0.25 per step, prompts 16-1024 and outputs 16-512 tokens uniform;
         60% n = 1, 20% n in {2, 4, 8}, 20% beam width in {2, 4, 8}; max_model_len 2048). At
         every step: slots allocated (used blocks x 16) versus slots holding a token, and the
         same for paged blocks without sharing and for contiguous per-sequence reservations of
         prompt + max_tokens (the best case of a static server, which must know each output
         length) and of max_model_len.
swap     ModelRunner on CPU with the demo model and a larger Llama (hidden 512, 8 layers,
         bench/lib/memory_swap.py): a preempted group of L tokens recomputed (one prefill) versus its
         blocks swapped out and back in, medians of at least --repeats runs, with --threads torch
         threads. One by default: on a host shared with other busy processes every parallel
         region of a 2-thread pool waits for a descheduled thread, which makes a 4-block swap
         take as long as a 128-block one; one thread times the work itself. The demo model's
         medians are what SchedulerConfig's swap_seconds_per_block and recompute_seconds_per_token
         default to.

Tables go to stdout (Markdown), everything to bench/results/memory-<time>.json.
"""

from __future__ import annotations

import argparse
import random
import time

from lib.machine_info import machine
from lib.memory_sim import SharingObserver, WasteObserver, WorkloadRequest, drive
from lib.memory_swap import SWAP_CYCLES, ModelTiming, measure_swap_and_recompute, prepare_bench_model, prepare_demo_model
from lib.output import markdown_table, save_report, timestamp
from lib.workload import MODELS_DIR

from pagedserve.scheduler.core.config import SchedulerConfig

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
WIDTHS = (2, 4, 8)
SHARING_WORKLOADS = {  # (prompt lengths, output lengths); prompts are not multiples of the block size
    "long prompts": ((37, 101, 165, 229, 293, 357, 421, 485), (128, 256) * 4),
    "short prompts": ((9, 13, 17, 21, 25, 29, 33, 37), (64, 128) * 4),
}
ARRIVALS_PER_STEP = 0.25
PARTS = ("sharing", "waste", "swap")


def scheduler_config() -> SchedulerConfig:
    """A pool large enough that nothing is preempted: block counts are the workload's own."""
    return SchedulerConfig(num_gpu_blocks=1 << 17, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                           max_num_seqs=256, max_num_batched_tokens=2048, enable_prefix_caching=False)


def percent_saved(shared: float, unshared: float) -> float:
    return 100.0 * (1.0 - shared / unshared) if unshared else 0.0


# ---- 1. sharing ------------------------------------------------------------------------------

def run_sharing() -> list[dict]:
    results = []
    for workload, (prompt_lens, output_lens) in SHARING_WORKLOADS.items():
        for kind in ("n", "beam"):
            for width in WIDTHS:
                results.append(measure_sharing(workload, kind, width, prompt_lens, output_lens))
    return results


def measure_sharing(workload: str, kind: str, width: int, prompt_lens: tuple[int, ...],
                    output_lens: tuple[int, ...]) -> dict:
    requests = [WorkloadRequest(f"{kind}{width}-{index}", prompt_len, output_len,
                                n=width if kind == "n" else 1, beam_width=width if kind == "beam" else 1)
                for index, (prompt_len, output_len) in enumerate(zip(prompt_lens, output_lens))]
    observer = SharingObserver(BLOCK_SIZE)
    num_steps = drive(scheduler_config(), requests, observer)
    shared, unshared = observer.blocks_shared, observer.blocks_unshared
    mean_shared, mean_unshared = sum(shared) / num_steps, sum(unshared) / num_steps
    mean_prompt_only = sum(observer.blocks_prompt_only) / num_steps
    return {
        "workload": workload, "kind": "parallel sampling" if kind == "n" else "beam search",
        "parameter": kind, "width": width,
        "num_steps": num_steps, "peak_blocks_shared": max(shared), "peak_blocks_unshared": max(unshared),
        "peak_percent_saved": percent_saved(max(shared), max(unshared)),
        "mean_blocks_shared": mean_shared, "mean_blocks_unshared": mean_unshared,
        "mean_percent_saved": percent_saved(mean_shared, mean_unshared),
        "mean_blocks_prompt_only": mean_prompt_only,
        "mean_percent_saved_prompt_only": percent_saved(mean_prompt_only, mean_unshared)}


def sharing_table(results: list[dict]) -> str:
    rows = [[row["workload"], row["kind"], f"{row['parameter']}={row['width']}", str(row["peak_blocks_shared"]),
             str(row["peak_blocks_unshared"]), f"{row['peak_percent_saved']:.1f}%",
             f"{row['mean_blocks_shared']:.0f}", f"{row['mean_blocks_unshared']:.0f}",
             f"{row['mean_percent_saved']:.1f}%", f"{row['mean_percent_saved_prompt_only']:.1f}%",
             str(row["num_steps"])] for row in results]
    return markdown_table(["workload", "request kind", "width", "peak shared", "peak unshared", "peak saved",
                           "mean shared", "mean unshared", "mean saved", "mean saved, prompt only", "steps"], rows)


# ---- 2. waste --------------------------------------------------------------------------------

def mixed_workload(num_requests: int, seed: int) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    requests = []
    arrival = 0.0
    for index in range(num_requests):
        arrival += rng.expovariate(ARRIVALS_PER_STEP)
        draw = rng.random()
        n = rng.choice(WIDTHS) if draw < 0.2 else 1
        beam_width = rng.choice(WIDTHS) if 0.2 <= draw < 0.4 else 1
        requests.append(WorkloadRequest(f"mixed-{index}", rng.randint(16, 1024), rng.randint(16, 512), n=n,
                                        beam_width=beam_width, arrival_step=int(arrival)))
    return requests


WASTE_ROWS = (("paged", "paged blocks (this pool)"),
              ("paged_unshared", "paged blocks, no sharing"),
              ("reserve_output", "contiguous, prompt + max_tokens per sequence"),
              ("reserve_max_len", f"contiguous, max_model_len ({MAX_MODEL_LEN}) per sequence"))


def run_waste(num_requests: int, seed: int) -> dict:
    requests = mixed_workload(num_requests, seed)
    observer = WasteObserver(BLOCK_SIZE, MAX_MODEL_LEN)
    num_steps = drive(scheduler_config(), requests, observer)
    kinds: dict[str, int] = {}
    for request in requests:
        kinds[request.kind] = kinds.get(request.kind, 0) + 1
    return {"num_requests": num_requests, "seed": seed, "num_steps": num_steps, "request_kinds": kinds,
            "mean_running_seqs": sum(observer.running_seqs) / num_steps,
            "mean_last_block_empty_slots": sum(observer.last_block_empty_slots) / num_steps,
            "layouts": {name: getattr(observer, name).summary() for name, _ in WASTE_ROWS}}


def waste_table(result: dict) -> str:
    paged = result["layouts"]["paged"]["mean_slots_allocated"]
    rows = []
    for name, label in WASTE_ROWS:
        layout = result["layouts"][name]
        rows.append([label, f"{layout['mean_slots_allocated']:,.0f}", f"{layout['mean_slots_filled']:,.0f}",
                     f"{layout['waste_percent']:.1f}%", f"{layout['peak_slots_allocated']:,}",
                     f"{layout['mean_slots_allocated'] / paged:.2f}x"])
    return markdown_table(["KV layout", "mean slots allocated", "mean slots holding a token", "waste",
                           "peak slots allocated", "memory vs paged"], rows)


# ---- 3. swap vs recompute --------------------------------------------------------------------

def run_swap(lengths: list[int], repeats: int) -> list[ModelTiming]:
    return [measure_swap_and_recompute(model, lengths, repeats=repeats)
            for model in (prepare_demo_model(), prepare_bench_model(MODELS_DIR))]


def swap_table(timings: list[ModelTiming]) -> str:
    rows = []
    for timing in timings:
        for row in timing.lengths:
            ratio = row.recompute_seconds / row.swap_seconds
            rows.append([timing.label, str(row.num_tokens), str(row.num_blocks), f"{row.recompute_seconds * 1e3:.2f}",
                         f"{row.swap_out_seconds * 1e3:.2f}", f"{row.swap_in_seconds * 1e3:.2f}",
                         f"{row.recompute_seconds_per_token * 1e6:.1f}", f"{row.swap_seconds_per_block * 1e6:.1f}",
                         f"{ratio:.1f}x", "swap" if ratio > 1 else "recompute",
                         f"{len(row.recompute_runs)} / {len(row.swap_runs)}"])
    return markdown_table(["model", "tokens", "blocks", "recompute ms", "swap out ms", "swap in ms",
                           "recompute us/token", "swap us/block", "recompute / swap", "cheaper", "runs"], rows)


def longest_recomputed_group(swap_seconds_per_block: float, recompute_seconds_per_token: float) -> int:
    """Longest group (tokens, held alone) that the cost rule of preemption_mode="auto" recomputes:
    L * recompute_seconds_per_token <= ceil(L / block_size) * swap_seconds_per_block; 0 if none."""
    return max((length for length in range(1, 4 * MAX_MODEL_LEN + 1)
                if length * recompute_seconds_per_token <= -(-length // BLOCK_SIZE) * swap_seconds_per_block),
               default=0)


def swap_summary_table(timings: list[ModelTiming]) -> str:
    defaults = SchedulerConfig(num_gpu_blocks=1, max_model_len=1)
    costs = [(timing.label, timing.swap_seconds_per_block, timing.recompute_seconds_per_token) for timing in timings]
    costs.append(("SchedulerConfig defaults", defaults.swap_seconds_per_block, defaults.recompute_seconds_per_token))
    details = {timing.label: [f"{timing.num_params / 1e6:.1f}M", f"{timing.bytes_per_block // 1024} KiB",
                              f"{timing.build_seconds:.1f}", f"{timing.load_seconds:.2f}"] for timing in timings}
    rows = []
    for label, swap, recompute in costs:
        longest = longest_recomputed_group(swap, recompute)
        rows.append([label, *details.get(label, [""] * 4), f"{swap:.2e}", f"{recompute:.2e}", f"{swap / recompute:.2f}",
                     f"{longest} tokens" if longest else "never"])
    return markdown_table(["model", "params", "KV per block", "build s", "load s", "swap s/block",
                           "recompute s/token", "break-even tokens/block", "auto recomputes up to"], rows)


# ---- main ------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per length (swap part); median kept")
    parser.add_argument("--lengths", default="64,256,1024,2048", help="group lengths in tokens (swap part)")
    parser.add_argument("--num-requests", type=int, default=256, help="requests of the mixed workload (waste part)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mixed workload")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the swap part")
    args = parser.parse_args()
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    args.lengths = [int(length) for length in args.lengths.split(",")]
    if args.repeats < 1 or args.num_requests < 1 or min(args.lengths) < 1 or args.threads < 1:
        parser.error("--repeats, --num-requests, --lengths and --threads must be positive")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    report: dict = {"machine": machine(), "block_size": BLOCK_SIZE, "args": {
        "parts": args.parts, "repeats": args.repeats, "lengths": args.lengths,
        "num_requests": args.num_requests, "seed": args.seed, "threads": args.threads}}
    if "sharing" in args.parts:
        part_started = time.perf_counter()
        report["sharing"] = run_sharing()
        shapes = "; ".join(f"{name}: {prompts[0]}-{prompts[-1]} prompt and {outputs[0]}/{outputs[1]} output tokens"
                           for name, (prompts, outputs) in SHARING_WORKLOADS.items())
        print(f"\n## 1. KV blocks with and without sharing (8 requests per batch; {shapes}; "
              f"block size {BLOCK_SIZE}; "
              f"{time.perf_counter() - part_started:.1f} s)\n")
        print(sharing_table(report["sharing"]))
    if "waste" in args.parts:
        part_started = time.perf_counter()
        waste = report["waste"] = run_waste(args.num_requests, args.seed)
        kinds = ", ".join(f"{kind}: {count}" for kind, count in sorted(waste["request_kinds"].items()))
        print(f"\n## 2. KV memory waste over a mixed workload ({args.num_requests} requests, seed {args.seed}; "
              f"{kinds}; {waste['num_steps']} steps, {waste['mean_running_seqs']:.0f} sequences running on "
              f"average; {time.perf_counter() - part_started:.1f} s)\n")
        print(waste_table(waste))
        paged = waste["layouts"]["paged"]
        empty = paged["mean_slots_allocated"] - paged["mean_slots_filled"]
        print(f"\nEmpty slots in partly filled last blocks: {waste['mean_last_block_empty_slots']:,.0f} on average, "
              f"of {empty:,.0f} empty paged slots.")
    if "swap" in args.parts:
        part_started = time.perf_counter()
        import torch

        torch.set_num_threads(args.threads)
        report["machine"]["torch"] = torch.__version__
        timings = run_swap(args.lengths, args.repeats)
        report["swap"] = [timing.as_dict() for timing in timings]
        num_threads = timings[0].num_threads
        print(f"\n## 3. Swap versus recompute of a preempted group (CPU, {num_threads} torch "
              f"thread{'s' if num_threads > 1 else ''}; "
              f"medians of at least {args.repeats} prefills and {args.repeats * SWAP_CYCLES} swap cycles per length; "
              f"{time.perf_counter() - part_started:.1f} s)\n")
        print(swap_table(timings))
        print()
        print(swap_summary_table(timings))
    report["wall_seconds"] = time.perf_counter() - started
    (path,) = save_report(f"memory-{timestamp()}", report)
    print(f"\nWall time {report['wall_seconds']:.1f} s; results in {path}")


if __name__ == "__main__":
    main()
