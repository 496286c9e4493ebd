"""What an output token costs each process through `serve`, whole and streamed: CPU time,
wake-ups and preemptions per token, for the scheduler, the worker, the frontend and this client.

    python bench/stream_costs.py [--model smollm2] [--tokens 300] [--rounds 3] [--modes whole,grpc,http]
                                 [--serve-args="--dtype bfloat16 --quantization none"]

One `pagedserve serve` with its default flags (or --serve-args) and the HTTP API. Each round sends, in turn, one
request of N greedy tokens (a 60-token prompt, end tokens ignored) per mode: `whole` over unary
Generate (the answer at the end), `grpc` over GenerateStream (a message per token), `http` over
POST /v1/completions with stream=true (an SSE chunk per token, lib/http_stream_client.py). Around
each request every thread's /proc counters are read: user and system CPU time, voluntary context
switches (a thread woken after it waited) and involuntary ones (a running thread preempted). The
client is this process: its asyncio loop and gRPC's threads. Per mode, the medians over the rounds
of ms per token and of each process's figures per token; a table to stdout, JSON to bench/results/.

On two cores the worker's threads fill both during a forward, so whatever the other processes do
for a token is time taken from the forward: the streamed modes' extra ms per token against `whole`
is what a token's trip through the scheduler, the frontend and the client costs the decode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from lib.http_stream_client import run_http_requests
from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from lib.stream_client import run_requests
from lib.workload import RESULTS_DIR, BenchRequest
from pagedserve.launch.serve_process import ServeProcess

MODES = ("whole", "grpc", "http")
PROMPT = list(range(100, 160))
TICK = os.sysconf("SC_CLK_TCK")


def thread_counters(pid: int) -> dict[int, tuple[float, int, int]]:
    """Per thread of pid: (CPU seconds, voluntary switches, involuntary switches)."""
    counters = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                switches = dict(line.split(":", 1) for line in status if "ctxt_switches" in line)
        except OSError:  # the thread ended meanwhile
            continue
        counters[int(tid)] = ((int(fields[11]) + int(fields[12])) / TICK,
                              int(switches["voluntary_ctxt_switches"]), int(switches["nonvoluntary_ctxt_switches"]))
    return counters


def per_token(before: dict, after: dict, num_tokens: int) -> dict[str, float]:
    """The process's CPU ms, wake-ups and preemptions per token between two readings (a thread
    started meanwhile counts from zero)."""
    sums = [0.0, 0, 0]
    for tid, values in after.items():
        base = before.get(tid, (0.0, 0, 0))
        for index in range(3):
            sums[index] += values[index] - base[index]
    return {"cpu_ms": sums[0] * 1e3 / num_tokens, "wakeups": sums[1] / num_tokens, "preemptions": sums[2] / num_tokens}


def one_request(server: ServeProcess, mode: str, request: BenchRequest) -> None:
    if mode == "http":
        run_http_requests(server.http_url, [request])
    else:
        run_requests(server.address, [request], whole=mode == "whole")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--serve-args", default="", help="flags for serve, one string (default: none)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    report = {"machine": machine(), "args": vars(args), "samples": {mode: [] for mode in modes}}
    request = BenchRequest(PROMPT, args.tokens)
    log_path = RESULTS_DIR / "logs" / f"stream_costs-{args.model}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with ServeProcess(args.model, log_path, args.serve_args.split(), http_port=True) as server:
        pids = {**server.child_pids(), "client": os.getpid()}
        for mode in modes:  # warm-up: each path's first request
            one_request(server, mode, BenchRequest(PROMPT, 8))
        report["load_average_start"] = os.getloadavg()
        for _ in range(args.rounds):
            for mode in modes:
                time.sleep(1.0)  # the previous request's tail settles
                before = {role: thread_counters(pid) for role, pid in pids.items()}
                started = time.perf_counter()
                one_request(server, mode, request)
                seconds = time.perf_counter() - started
                after = {role: thread_counters(pid) for role, pid in pids.items()}
                report["samples"][mode].append(
                    {"ms_per_token": seconds * 1e3 / args.tokens,
                     "processes": {role: per_token(before[role], after[role], args.tokens) for role in pids}})
    rows = []
    for mode, samples in report["samples"].items():
        ms_per_token = statistics.median(sample["ms_per_token"] for sample in samples)
        for role in pids:
            rows.append({"mode": mode, "ms/token": ms_per_token, "process": role,
                         **{label: statistics.median(sample["processes"][role][key] for sample in samples)
                            for key, label in (("cpu_ms", "CPU ms/token"), ("wakeups", "wake-ups/token"),
                                               ("preemptions", "preemptions/token"))}})
    report["medians"] = rows
    print_table(rows, title=f"per output token, {args.model} {args.serve_args or '(default flags)'}, one request at "
                            f"a time (medians of {args.rounds}), {report['machine']['cpu']}")
    (path,) = save_report(f"stream_costs-{timestamp()}", report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
