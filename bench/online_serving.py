"""Online serving: latency of pagedserve under Poisson arrivals, and chunked prefill's effect on ITL.

    python bench/online_serving.py [--rates 0.5,1,2,4] [--num-requests 40] [--dtype float32] [--threads 1]
                                   [--protocol grpc|http|both]

1. Request rates. For each rate, --num-requests requests (prompt lengths uniform in 32-256,
   output lengths in 32-128, greedy, EOS ignored) arrive with exponential gaps (seeded) at one
   `pagedserve serve`, streamed over GenerateStream (--protocol grpc), over the OpenAI-compatible
   HTTP API's streamed /v1/completions (http), or both, one after the other at the same rate with
   the same requests, on the same server (both; which goes first alternates between rates). Per rate and protocol: TTFT (send to first token), inter-token
   latency (gap between consecutive tokens of a request), end-to-end latency (p50/p90/p99),
   output tokens/s over the run, and the frontend process's CPU time per streamed token (what
   the protocol costs: user + system seconds of the frontend over the run / tokens streamed), and
   the benchmark client's (on a small machine a client's CPU is taken from the server's).
2. Chunked prefill. 16 requests decode 160 tokens each; one second in, 4 requests with
   1,500-token prompts arrive at once. Run twice: with a 256-token step budget
   (--max-num-batched-tokens 256: each long prompt is prefilled in chunks of at most 256 tokens
   minus the decodes, so the decodes keep their pace) and with a 2,048-token budget (each long prompt
   prefilled in one step, its forward stalling every decode). Reported: the decoding
   requests' ITL percentiles and worst gap, and the time line of their gaps.
A table goes to stdout, JSON and a PNG to bench/results/.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from tqdm import tqdm

from lib.machine_info import machine
from lib.output import print_table, save_figure, save_report, timestamp
from pagedserve.launch.serve_process import ServeProcess
from lib.http_stream_client import run_http_requests
from lib.decode_steps import cpu_seconds
from lib.stream_client import RequestTrace, run_requests
from lib.workload import BENCH_MODEL, RESULTS_DIR, BenchRequest, build_model, make_requests

WARMUP = [BenchRequest(list(range(4, 68)), 8)]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": ordered[-1]}


def summarize(traces: list[RequestTrace]) -> dict:
    start = min(trace.sent_at for trace in traces)
    end = max(trace.finished_at for trace in traces)
    num_tokens = sum(trace.num_tokens for trace in traces)
    return {"num_requests": len(traces), "seconds": end - start, "num_output_tokens": num_tokens,
            "output_tokens_per_second": num_tokens / (end - start),
            "ttft_ms": {k: v * 1e3 for k, v in percentiles([t.ttft for t in traces]).items()},
            "itl_ms": {k: v * 1e3 for k, v in percentiles(
                [gap for t in traces for gap in t.inter_token_gaps]).items()},
            "latency_s": percentiles([t.latency for t in traces])}


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    for _ in range(num_requests):
        arrivals.append(now)
        now += rng.expovariate(rate)
    return arrivals


def serve_args(dtype: str, max_num_batched_tokens: int) -> list[str]:
    return ["--dtype", dtype, "--max-num-seqs", "256", "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--num-kv-blocks", "4096", "--swap-space", "0.25"]


def uncached(requests: list[BenchRequest], salt: int) -> list[BenchRequest]:
    """The same lengths with the first prompt token set to 4 + salt: the runs of the protocols
    compared at one rate share no prefix-cache blocks (the second would find every prompt cached)."""
    return [BenchRequest([4 + salt, *request.prompt_token_ids[1:]], request.max_tokens) for request in requests]


def rate_sweep(model_path: Path, args, log_dir: Path) -> list[dict]:
    rows = []
    protocols = ["grpc", "http"] if args.protocol == "both" else [args.protocol]
    with ServeProcess(model_path, log_dir / "serve-rates.log", serve_args(args.dtype, 2048),
                      num_threads=args.threads, http_port="http" in protocols) as server:
        frontend_pid = server.child_pids()["frontend"]
        senders = {"grpc": lambda *a, **k: run_requests(server.address, *a, **k),
                   "http": lambda *a, **k: run_http_requests(server.http_url, *a, **k)}
        for protocol in protocols:
            senders[protocol](WARMUP)
        for index, rate in enumerate(args.rates):
            requests = make_requests(args.num_requests, (32, 256), (32, 128), seed=100 + index)
            arrivals = poisson_arrivals(len(requests), rate, seed=200 + index)
            for protocol in protocols if index % 2 == 0 else protocols[::-1]:  # neither always goes first
                with tqdm(total=len(requests), desc=f"rate {rate}/s {protocol}", unit="req", leave=False) as bar:
                    cpu_before, client_cpu_before = cpu_seconds(frontend_pid), time.process_time()
                    traces = senders[protocol](uncached(requests, protocols.index(protocol)), arrivals,
                                               on_done=lambda: bar.update(1))
                    frontend_cpu = cpu_seconds(frontend_pid) - cpu_before
                    client_cpu = time.process_time() - client_cpu_before
                row = {"rate": rate, "protocol": protocol, **summarize(traces)}
                row["frontend_cpu_ms_per_token"] = frontend_cpu * 1e3 / row["num_output_tokens"]
                row["client_cpu_ms_per_token"] = client_cpu * 1e3 / row["num_output_tokens"]
                rows.append(row)
                print(f"  rate {rate}/s {protocol}: {row['output_tokens_per_second']:.1f} tok/s, TTFT p50 "
                      f"{row['ttft_ms']['p50']:.0f} ms, ITL p50 {row['itl_ms']['p50']:.0f} ms, frontend CPU "
                      f"{row['frontend_cpu_ms_per_token']:.3f} ms/token", flush=True)
    return rows


def chunked_prefill_run(model_path: Path, args, budget: int, log_dir: Path) -> dict:
    decoders = make_requests(16, (64, 64), (160, 160), seed=300)
    long_prompts = make_requests(4, (1500, 1500), (16, 16), seed=301)
    requests = decoders + long_prompts
    arrivals = [0.0] * len(decoders) + [args.long_prompt_delay] * len(long_prompts)
    with ServeProcess(model_path, log_dir / f"serve-budget-{budget}.log", serve_args(args.dtype, budget),
                      num_threads=args.threads) as server:
        run_requests(server.address, WARMUP)
        with tqdm(total=len(requests), desc=f"budget {budget}", unit="req", leave=False) as bar:
            traces = run_requests(server.address, requests, arrivals, on_done=lambda: bar.update(1))
    decoding = traces[:len(decoders)]
    start = min(trace.sent_at for trace in traces)
    long_sent = min(trace.sent_at for trace in traces[len(decoders):])
    long_done = max(trace.token_times[0] for trace in traces[len(decoders):])  # every long prompt prefilled
    gaps, during = [], []
    for trace in decoding:
        for earlier, later in zip(trace.token_times, trace.token_times[1:]):
            gaps.append({"t": later - start, "gap_ms": (later - earlier) * 1e3})
            if long_sent <= later <= long_done:
                during.append(later - earlier)
    return {"max_num_batched_tokens": budget,
            "decode_itl_ms": {k: v * 1e3 for k, v in percentiles(
                [gap for trace in decoding for gap in trace.inter_token_gaps]).items()},
            "decode_itl_during_long_prefill_ms": {k: v * 1e3 for k, v in percentiles(during).items()},
            "long_prompt_ttft_s": percentiles([trace.ttft for trace in traces[len(decoders):]]),
            "long_prefill_window_s": [long_sent - start, long_done - start],
            "gaps": sorted(gaps, key=lambda gap: gap["t"])}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, itl) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = [row for row in report["rates"] if row["protocol"] == report["rates"][0]["protocol"]]
    rates = [row["rate"] for row in rows]
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
        for pct, style in (("p50", "-"), ("p99", "--")):
            latency.plot(rates, [row[key][pct] for row in rows], style, marker="o", label=f"{label} {pct}")
    latency.set_yscale("log")
    latency.set_xlabel("request rate (requests / s, Poisson)")
    latency.set_ylabel("ms")
    throughput = latency.twinx()
    throughput.plot(rates, [row["output_tokens_per_second"] for row in rows], ":", color="black", marker="s",
                    label="output tok/s")
    throughput.set_ylabel("output tokens / s")
    latency.legend(fontsize=8, loc="upper left")
    throughput.legend(fontsize=8, loc="lower right")
    latency.set_title(f"pagedserve under Poisson load ({report['dtype']})")
    for run in report["chunked_prefill"]:
        label = f"budget {run['max_num_batched_tokens']} tokens"
        itl.plot([g["t"] for g in run["gaps"]], [g["gap_ms"] for g in run["gaps"]], ".", markersize=3, label=label)
    itl.set_yscale("log")
    itl.set_xlabel("seconds since the decoding requests were sent")
    itl.set_ylabel("gap between a decoding request's tokens (ms)")
    itl.set_title("4 x 1,500-token prompts arrive among 16 decodes")
    itl.legend(fontsize=8)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1,2,4")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--long-prompt-delay", type=float, default=1.0)
    parser.add_argument("--skip-rates", action="store_true")
    parser.add_argument("--skip-chunked", action="store_true")
    parser.add_argument("--protocol", choices=["grpc", "http", "both"], default="grpc",
                        help="how the rate sweep streams: gRPC GenerateStream, OpenAI HTTP SSE, or both")
    args = parser.parse_args()
    args.rates = [float(rate) for rate in args.rates.split(",")]
    stamp = timestamp()
    log_dir = RESULTS_DIR / f"online-{stamp}-logs"
    model_path = build_model(BENCH_MODEL)
    report = {"machine": machine("torch", "transformers"), "dtype": args.dtype, "threads": args.threads, "model": BENCH_MODEL.name,
              "rates": [], "chunked_prefill": []}
    started = time.perf_counter()
    if not args.skip_rates:
        report["rates"] = rate_sweep(model_path, args, log_dir)
        print_table(report["rates"], [
            ("rate/s", lambda r: r["rate"]), ("protocol", lambda r: r["protocol"]),
            ("tok/s", lambda r: r["output_tokens_per_second"]),
            *((f"TTFT {p} ms", (lambda p: lambda r: r["ttft_ms"][p])(p)) for p in ("p50", "p90", "p99")),
            *((f"ITL {p} ms", (lambda p: lambda r: r["itl_ms"][p])(p)) for p in ("p50", "p90", "p99")),
            *((f"E2E {p} s", (lambda p: lambda r: r["latency_s"][p])(p)) for p in ("p50", "p90", "p99")),
            ("frontend CPU ms/token", lambda r: f"{r['frontend_cpu_ms_per_token']:.3f}"),
            ("client CPU ms/token", lambda r: f"{r['client_cpu_ms_per_token']:.3f}")])
    if not args.skip_chunked:
        for budget in (256, 2048):
            report["chunked_prefill"].append(chunked_prefill_run(model_path, args, budget, log_dir))
        print_table(report["chunked_prefill"], [
            ("step budget", lambda r: r["max_num_batched_tokens"]),
            ("decode ITL p50 ms", lambda r: r["decode_itl_ms"]["p50"]),
            ("p99 ms", lambda r: r["decode_itl_ms"]["p99"]),
            ("max ms", lambda r: r["decode_itl_ms"]["max"]),
            ("during long prefill p50 ms", lambda r: r["decode_itl_during_long_prefill_ms"]["p50"]),
            ("max ms", lambda r: r["decode_itl_during_long_prefill_ms"]["max"]),
            ("long-prompt TTFT p50 s", lambda r: r["long_prompt_ttft_s"]["p50"])])
    report["wall_seconds"] = time.perf_counter() - started
    paths = save_report(f"online-{stamp}", report,
                        plot if report["rates"] and report["chunked_prefill"] else None)
    print(f"wrote {' and '.join(map(str, paths))} ({report['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
