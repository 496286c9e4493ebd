"""How long `serve` takes to become ready and to stop, and what each process holds right after
it is ready: what a new replica, an autoscaled one and a restarted one each pay.

    python bench/startup.py [--models demo,smollm2] [--starts 3]

Each start: `pagedserve serve --model M` with its default flags (ServeProcess), the time until
its readiness check (grpc.health.v1, service pagedserve.v1.Generation) answers SERVING, each
child's VmRSS then, and the time `stop()` takes (SIGTERM to serve until it has exited). The first
start of a model also fills the caches a later start reads (the demo checkpoint, the GGUF file's
tokenizer and config, the kernels' per-host tuning), so it is reported apart. A table goes to
stdout, JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.launch.serve_process import ServeProcess
from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_start(model: str, log_path: Path) -> dict:
    started = time.monotonic()
    server = ServeProcess(model, log_path, [])
    try:
        server.wait_ready()
        ready = time.monotonic() - started
        rss = {role: resident_mib(pid) for role, pid in sorted(server.child_pids().items())}
    finally:
        stopping = time.monotonic()
        code = server.stop()
    return {"ready_seconds": ready, "stop_seconds": time.monotonic() - stopping, "exit_code": code,
            "rss_mib": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,smollm2")
    parser.add_argument("--starts", type=int, default=3, help="starts per model after the first")
    args = parser.parse_args()
    report = {"machine": machine(), "args": vars(args), "models": {}}
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for model in args.models.split(","):
            first = one_start(model, Path(logs) / f"{model}-first.log")
            starts = [one_start(model, Path(logs) / f"{model}-{index}.log") for index in range(args.starts)]
            report["models"][model] = {"first": first, "starts": starts}
            for label, runs in (("first start", [first]), (f"next {len(starts)}", starts)):
                roles = runs[0]["rss_mib"]
                rows.append({"model": model, "starts": label,
                             "ready s": statistics.median(run["ready_seconds"] for run in runs),
                             "stop s": statistics.median(run["stop_seconds"] for run in runs),
                             **{f"{role} MiB": statistics.median(run["rss_mib"].get(role, float("nan")) for run in runs)
                                for role in roles}})
    print_table(rows, title=f"serve start and stop (medians), {report['machine']['cpu']}")
    (path,) = save_report(f"startup-{timestamp()}", report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
