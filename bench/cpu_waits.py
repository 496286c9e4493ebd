"""How the worker's OpenMP threads wait, through `serve`: passive, spinning, and the default
(spinning, one thread while other processes use the cores; worker/cpu_share.py).

    python bench/cpu_waits.py [--configs default,passive,spin30000] [--rounds 2] [--beside-busy-process]

One `pagedserve serve --model smollm2` per configuration (its environment: `passive` sets
OMP_WAIT_POLICY=PASSIVE, `spinN` sets GOMP_SPINCOUNT=N, `default` sets neither), all started
before the runs. Each round sends, to every server in turn, two chat requests one after the other
(64 output tokens, the one-stream rate) and then 32 at once (96 tokens each), greedy; output
tokens / summed time, cumulated over the rounds. `--beside-busy-process` starts a CPU-bound Python
process (a busy loop) before the rounds and stops it after them: another job on the host.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from lib.output import print_table
from pagedserve.launch.serve_process import ServeProcess
from lib.spec_workload import CHAT, GROUNDED, chat_request
from lib.workload import RESULTS_DIR

PROMPTS = GROUNDED + CHAT


def environment(config: str) -> dict[str, str]:
    """What a configuration adds to this process's environment (which main() clears of both)."""
    if config == "default":
        return {}
    if config == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if config.startswith("spin"):
        return {"GOMP_SPINCOUNT": config.removeprefix("spin")}
    raise SystemExit(f"unknown configuration {config!r}: default, passive or spinN")


def serve(config: str, threads: int) -> ServeProcess:
    server = ServeProcess("smollm2", RESULTS_DIR / "logs" / f"cpu_waits-{config}.log", ["--max-num-seqs", "64"],
                          env=environment(config), num_threads=threads)
    server.wait_ready()
    server.stub.Generate(chat_request(PROMPTS[0], 8), timeout=600)  # warm-up
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="default,passive,spin30000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beside-busy-process", action="store_true")
    args = parser.parse_args()
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        os.environ.pop(name, None)
    servers = {}
    busy = None
    totals = {}
    try:
        for config in args.configs.split(","):
            servers[config] = serve(config, args.threads)
            totals[config] = {"one_seconds": 0.0, "one_tokens": 0, "many_seconds": 0.0, "many_tokens": 0}
        if args.beside_busy_process:
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(2.0)
        for round_index in range(args.rounds):
            for config, server in servers.items():
                total = totals[config]
                for text in PROMPTS[2 * round_index % len(PROMPTS):][:2]:
                    started = time.perf_counter()
                    response = server.stub.Generate(chat_request(text, 64), timeout=600)
                    total["one_seconds"] += time.perf_counter() - started
                    total["one_tokens"] += response.usage.completion_tokens
                many = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
                started = time.perf_counter()
                with ThreadPoolExecutor(len(many)) as pool:
                    responses = list(pool.map(
                        lambda text: server.stub.Generate(chat_request(text, 96), timeout=600), many))
                total["many_seconds"] += time.perf_counter() - started
                total["many_tokens"] += sum(r.usage.completion_tokens for r in responses)
    finally:
        if busy is not None:
            busy.kill()
        for server in servers.values():
            server.stop()
    rows = [{"config": config, "one_stream_tokens_per_second": t["one_tokens"] / t["one_seconds"],
             "32_streams_tokens_per_second": t["many_tokens"] / t["many_seconds"]} for config, t in totals.items()]
    print_table(rows, title="worker OpenMP waits" + (" beside a busy process" if args.beside_busy_process else ""))


if __name__ == "__main__":
    main()
