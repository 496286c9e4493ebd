"""Speculative decoding (n-gram prompt lookup, a draft model) on a real model: one stream and 32 streams.

    python bench/spec_speedup.py [--model smollm2] [--max-tokens 160] [--threads 2] [--k 4]
                                [--methods ngram[,draft]] [--speculative-model PATH]
                                [--speculative-quantization none|int8|int4|auto]
                                [--streams 32] [--rounds 2] [--skip-streams] [--skip-one-stream]
                                [--serve-args FLAG ...]

Workloads, greedy, through the public gRPC API with the model's chat template:
  grounded   rewrite / summarize / edit a given passage, edit given code: the answer copies long
             runs of the prompt, which is what prompt lookup proposes
  chat       open-ended questions: little to copy
Each configuration is its own `pagedserve serve`, all started before the runs: speculation off,
and per method of --methods K proposals per step with --speculative-disable-batch-size high enough
to speculate at every batch size, and (streams) the method at the default threshold. The draft
method runs --speculative-model (default: --model itself) with --speculative-quantization
(default int4: the cheap self-draft). One stream: each request is sent
to every server in turn, one request at a time, so all configurations see the same machine load
(the host may be shared); output tokens / summed request time. 32 streams: 32 requests at once
(grounded and chat mixed) on each server in turn, --rounds times; output tokens / summed time. Acceptance rate (accepted / proposed) and mean accepted length
(tokens emitted per verifying sequence step: accepted + 1) come from the scheduler's metrics.
A table goes to stdout and JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from lib.spec_workload import CHAT, GROUNDED, chat_request, finish, serve, spec_counters
from pagedserve.launch.serve_process import ServeProcess


def run_one_stream(servers: dict[str, ServeProcess], prompts: list[str], max_tokens: int) -> dict[str, dict]:
    """Each prompt on every server in turn (the same machine load for all of them), one at a time."""
    totals = {name: {"seconds": 0.0, "num_output_tokens": 0, "outputs": []} for name in servers}
    before = {name: spec_counters(server) for name, server in servers.items()}
    for text in prompts:
        for name, server in servers.items():
            started = time.perf_counter()
            response = server.stub.Generate(chat_request(text, max_tokens), timeout=3600)
            totals[name]["seconds"] += time.perf_counter() - started
            totals[name]["num_output_tokens"] += response.usage.completion_tokens
            totals[name]["outputs"].append(list(response.completions[0].token_ids))
    return {name: finish(totals[name], before[name], spec_counters(server), len(prompts))
            for name, server in servers.items()}


def run_streams(servers: dict[str, ServeProcess], prompts: list[str], max_tokens: int, rounds: int) -> dict[str, dict]:
    """All prompts at once on each server in turn, `rounds` times, alternating the servers."""
    totals = {name: {"seconds": 0.0, "num_output_tokens": 0, "outputs": []} for name in servers}
    before = {name: spec_counters(server) for name, server in servers.items()}
    for round_index in range(rounds):
        for name, server in servers.items():
            started = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                responses = list(pool.map(
                    lambda text: server.stub.Generate(chat_request(text, max_tokens), timeout=3600), prompts))
            totals[name]["seconds"] += time.perf_counter() - started
            totals[name]["num_output_tokens"] += sum(r.usage.completion_tokens for r in responses)
            if round_index == 0:
                totals[name]["outputs"] = [list(r.completions[0].token_ids) for r in responses]
    return {name: finish(totals[name], before[name], spec_counters(server), len(prompts) * rounds)
            for name, server in servers.items()}


def method_flags(args, method: str) -> list[str]:
    """serve's flags of one speculation method with K proposals per step."""
    flags = ["--speculative-method", method, "--num-speculative-tokens", str(args.k)]
    if method == "draft":
        flags += ["--speculative-model", args.speculative_model or args.model,
                  "--speculative-quantization", args.speculative_quantization]
    return flags


def add_rows(rows: list[dict], workload: str, results: dict[str, dict]) -> None:
    baseline = results["off"]
    for name, result in results.items():
        row = {"config": name, "workload": workload, **{k: v for k, v in result.items() if k != "outputs"},
               "speedup": result["tokens_per_second"] / baseline["tokens_per_second"]}
        if name != "off":
            row["is_same_output"] = result["outputs"] == baseline["outputs"]
        rows.append(row)
        print(row, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="proposed tokens per step")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the streams workload per server")
    parser.add_argument("--skip-streams", action="store_true")
    parser.add_argument("--skip-one-stream", action="store_true")
    parser.add_argument("--methods", default="ngram", help="comma-separated: ngram, draft")
    parser.add_argument("--speculative-model", default=None, help="the draft method's model (default: --model)")
    parser.add_argument("--speculative-quantization", default="int4", choices=("none", "int8", "int4", "auto"))
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="flags for every server, e.g. --dtype float32 --quantization none")
    args = parser.parse_args()
    methods = [method.strip() for method in args.methods.split(",") if method.strip()]
    unknown = set(methods) - {"ngram", "draft"}
    if unknown:
        parser.error(f"unknown --methods {sorted(unknown)}: ngram, draft")
    flags = {method: method_flags(args, method) for method in methods}
    always = {method: f"{method} K={args.k}" for method in methods}
    rows: list[dict] = []
    servers = {"off": serve(args, "off", [])}
    for method in methods:
        servers[always[method]] = serve(args, f"{method}-always",
                                        [*flags[method], "--speculative-disable-batch-size", "1024"])
    many = [(GROUNDED + CHAT)[i % (len(GROUNDED) + len(CHAT))] for i in range(args.streams)]
    try:
        if not args.skip_one_stream:
            add_rows(rows, "grounded, 1 stream", run_one_stream(servers, GROUNDED, args.max_tokens))
            add_rows(rows, "chat, 1 stream", run_one_stream(servers, CHAT, args.max_tokens))
        if not args.skip_streams:
            add_rows(rows, f"{args.streams} streams", run_streams(servers, many, args.max_tokens, args.rounds))
            for method in methods:
                servers.pop(always[method]).stop()
                servers[f"{method} K={args.k}, default threshold"] = serve(args, f"{method}-default", flags[method])
            add_rows(rows, f"{args.streams} streams", run_streams(servers, many, args.max_tokens, args.rounds))
    finally:
        for server in servers.values():
            server.stop()
    print_table(rows, ["config", "workload", "num_output_tokens", "seconds", "tokens_per_second", "speedup",
                       "acceptance_rate", "mean_accepted_length", "is_same_output"],
                title=f"speculative decoding ({', '.join(methods)})")
    save_report(f"speculative-{timestamp()}", {"machine": machine("torch"), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
