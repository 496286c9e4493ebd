"""guidellm, a load generator pagedserve did not write, against pagedserve's `serve` and llama.cpp's
`llama-server` on SmolLM2-135M-Instruct, in one run.

    python bench/guidellm_chat.py [--shapes 256x64,...] [--concurrency 1,8,32] [--duration 60 | --max-requests N]
                                  [--seed 0] [--threads T] [--systems pagedserve,llama.cpp] [--no-keep]
                                  [--warmup-fraction 0.1] [--llama-server PATH] [--llama-args "..."]
                                  [--guidellm PATH] [--guidellm-processes 1]

Both servers start once, on the same GGUF file, and stay up for the whole sweep:

    pagedserve   `pagedserve serve --model smollm2` with its DEFAULT flags (the GGUF's Q4_1 linear
                 weights kept as they are, activations and KV cache in --dtype auto: bfloat16 on
                 CPUs with native bfloat16, else float32), OpenAI HTTP API on a free port
    llama.cpp    `llama-server -m <the same GGUF> -t T -tb T -np C -c C*ctx -cb -ctk K -ctv K`:
                 T = this machine's cores, C = the largest concurrency (a slot per stream), ctx =
                 the longest shape's prompt + output + chat template, rounded up to 256; K = f16
                 where pagedserve serves bfloat16 (a 16-bit KV cache both), f32 where it serves
                 float32; --llama-args adds flags (e.g. "--poll 0" on a busy CPU); skipped with a
                 note when the binary is not found (--llama-server, $LLAMA_SERVER, default:
                 the build under ~/.cache/pagedserve/llama.cpp)

Each point (a shape PROMPTxOUTPUT tokens, a concurrency) runs `guidellm run` once per server, one
server after the other (the first server alternates from point to point, so load drifts hit both;
the other server is idle meanwhile): a concurrent profile of C streams, synthetic chat prompts
on /v1/chat/completions, streamed, `max_completion_tokens` = OUTPUT with `ignore_eos`, greedy
(temperature 0 on both: their default samplers differ), for --duration seconds or --max-requests
requests, the first and last --warmup-fraction left out of the figures (guidellm's warmup and
cooldown; by requests it leaves out at least one at each end). Both servers get the same
prompts at a point (the same seed); every point has its own seed, so no point reuses another's
prompts from a prefix cache. guidellm runs offline from its own virtual environment
(bench/lib/guidellm_client.py), on the model's tokenizer folder, with one worker process by
default (--guidellm-processes); it shares the CPU with the server it measures, and the JSON says
how much CPU time it took.

Figures per server and point (guidellm's statistics): output tokens/s, requests/s, TTFT p50/p99,
ITL p50/p99 (ms); ratios are pagedserve / llama.cpp (tokens/s: above 1 is pagedserve faster;
TTFT and ITL: below 1 is pagedserve faster). A table goes to stdout, JSON (with the CPU, the load
average, the date, every command line, and from serve's log the worker's thread-count changes and
refused requests) to bench/results/, its figures also to bench/results/kept/ (make perf-tables)
unless --no-keep. A failed request or an output of another length than asked ends the run with an
error, after the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from lib.guidellm_client import (
    Budget, Point, PointFigures, Shape, default_guidellm, guidellm_version, install_hint, point_command, run_point,
)
from lib.llama_server import LlamaServer, default_llama_server, start_llama_server
from lib.machine_info import machine
from lib.output import RESULTS_DIR, print_table, save_report, timestamp
from pagedserve.checkpoints.smollm2 import ensure_smollm2
from pagedserve.cpu_features import cpu_auto_dtype
from pagedserve.launch.serve_process import ServeProcess
from perf_tables import save_kept

SYSTEMS = ("pagedserve", "llama.cpp")
MODEL = "smollm2"  # the id `serve --model smollm2` serves under; llama-server gets it as its alias
SAMPLING = {"temperature": 0.0}  # sent by guidellm with every request, to both servers
LLAMA_KV_TYPE = {"bfloat16": "f16", "float32": "f32"}  # pagedserve's dtype -> llama-server's KV cache type
CHAT_TEMPLATE_TOKENS = 64  # SmolLM2's template and default system prompt, with room to spare
CONTEXT_ROUND = 256
# table column -> figure whose pagedserve / llama.cpp ratio it shows on the ratio row
RATIO_COLUMNS = {"output tok/s": "output_tokens_per_second", "TTFT p50 ms": "ttft_p50_ms", "ITL p50 ms": "itl_p50_ms",
                 "ITL p99 ms": "itl_p99_ms"}


@dataclass(frozen=True)
class Target:
    """One server under test: its process (which has `wait_idle`), its OpenAI base URL, its command."""

    server: ServeProcess | LlamaServer
    url: str
    command: str


@dataclass(frozen=True)
class Sweep:
    """What every guidellm run of the sweep shares."""

    guidellm: Path
    tokenizer: Path
    budget: Budget
    warmup_fraction: float
    num_processes: int
    log_dir: Path


# --- servers ---

def tokenizer_folder(gguf: Path, fallback: Path) -> Path:
    """The folder pagedserve converts the GGUF's tokenizer into (cached), or fallback when the
    cache cannot be written."""
    from pagedserve.frontend.tokenization.gguf_tokenizer import load_gguf_tokenizer, tokenizer_cache_path

    tokenizer = load_gguf_tokenizer(gguf)
    folder = tokenizer_cache_path(gguf)
    if not (folder / "tokenizer_config.json").is_file():
        tokenizer.save_pretrained(str(fallback))
        folder = fallback
    return folder


def warm_up(http_url: str, model: str, prompt_tokens: int) -> None:
    """One chat request of about prompt_tokens tokens, so that no point pays a server's first use."""
    body = {"model": model, "messages": [{"role": "user", "content": "warm " * prompt_tokens}],
            "max_completion_tokens": 8, "ignore_eos": True, **SAMPLING}
    request = urllib.request.Request(f"{http_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def start_targets(stack: ExitStack, args: argparse.Namespace, gguf: Path, dtype: str, context_per_slot: int,
                  log_dir: Path) -> dict[str, Target]:
    """The servers of args.systems, started one after the other, stopped when the stack closes;
    each warmed up."""
    targets = {}
    if "pagedserve" in args.systems:
        serve = stack.enter_context(ServeProcess(MODEL, log_dir / "serve.log", http_port=True))
        targets["pagedserve"] = Target(serve, serve.http_url, " ".join(serve.command))
    if "llama.cpp" in args.systems:
        kv_type = LLAMA_KV_TYPE[dtype]
        llama = start_llama_server(args.llama_server, gguf, log_dir / "llama-server.log",
                                   num_slots=max(args.concurrency), context_per_slot=context_per_slot,
                                   num_threads=args.threads,
                                   extra_args=["-cb", "-a", MODEL, "-ctk", kv_type, "-ctv", kv_type,
                                               *shlex.split(args.llama_args)])
        stack.callback(llama.stop)
        targets["llama.cpp"] = Target(llama, llama.url, " ".join(llama.command))
    for target in targets.values():
        warm_up(target.url, MODEL, max(shape.prompt_tokens for shape in args.shapes))
    return targets


# --- the sweep ---

def run_sweep(targets: dict[str, Target], points: list[Point], sweep: Sweep) -> tuple[list[dict], list[str]]:
    """Every point on every server, the first server alternating; returns the points' entries and
    the problems met (failed requests, other output lengths)."""
    entries, problems = [], []
    for index, point in enumerate(points):
        entry = {"shape": str(point.shape), "prompt_tokens": point.shape.prompt_tokens,
                 "output_tokens": point.shape.output_tokens, "concurrency": point.concurrency, "seed": point.seed,
                 "systems": {}, "guidellm_commands": {}}
        for system in list(targets) if index % 2 == 0 else list(reversed(targets)):
            for target in targets.values():
                target.server.wait_idle()  # the requests of the last run have ended there too
            figures, command = measure(system, targets[system], point, sweep)
            entry["systems"][system] = figures.to_json()
            entry["guidellm_commands"][system] = " ".join(command)
            problems += check_point(system, point, figures)
            print(f"  {point.shape}, {point.concurrency} streams, {system}: {figures.output_tokens_per_second:.1f} "
                  f"output tok/s, TTFT p50 {figures.ttft_p50_ms:.0f} ms, ITL p50 {figures.itl_p50_ms:.1f} ms "
                  f"({figures.num_completed} completed; guidellm used {figures.client_cpu_seconds:.0f} CPU s in "
                  f"{figures.client_wall_seconds:.0f} s; load average {os.getloadavg()[0]:.2f})", flush=True)
        entry["systems"] = {system: entry["systems"][system] for system in targets}  # pagedserve first
        entry["ratios"] = ratios(entry["systems"])
        entries.append(entry)
    return entries, problems


def measure(system: str, target: Target, point: Point, sweep: Sweep) -> tuple[PointFigures, list[str]]:
    name = f"{system.replace('.', '')}-{point.shape}-c{point.concurrency}"
    output = sweep.log_dir / f"{name}.json"
    command = point_command(sweep.guidellm, point, target=target.url, model=MODEL, tokenizer=sweep.tokenizer,
                            budget=sweep.budget, output=output, warmup_fraction=sweep.warmup_fraction, body=SAMPLING)
    figures = run_point(command, output, sweep.log_dir / f"{name}.log", num_processes=sweep.num_processes,
                        budget=sweep.budget)
    return figures, command


def check_point(system: str, point: Point, figures: PointFigures) -> list[str]:
    """What did not go as asked: failed requests, no completed request, other output lengths."""
    where = f"{system} at {point.shape}, {point.concurrency} streams"
    problems = []
    if figures.num_errored:
        problems.append(f"{where}: {figures.num_errored} request(s) failed; the first: {figures.first_error}")
    if not figures.num_completed:
        problems.append(f"{where}: no request completed")
    elif {figures.output_tokens_min, figures.output_tokens_max} != {point.shape.output_tokens}:
        problems.append(f"{where}: completed requests had {figures.output_tokens_min:g}-{figures.output_tokens_max:g} "
                        f"output tokens, {point.shape.output_tokens} asked for")
    return problems


# --- the report ---

def serve_events(serve_log: Path, name: str, keys: tuple[str, ...]) -> list[dict]:
    """The events called name in serve's log (JSON lines), with the keys asked for."""
    events = []
    for line in serve_log.read_text(errors="replace").splitlines() if serve_log.is_file() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            events.append({key: event.get(key) for key in keys})
    return events


def add_serve_log_findings(report: dict, serve_log: Path) -> None:
    """The worker's thread-count changes (worker/cpu_share.py drops to one thread while other
    processes use more than half a core) into the notes, and the reason of pagedserve's first
    refused request into the problems (guidellm only says '400 Bad Request')."""
    changes = serve_events(serve_log, "cpu_threads_changed", ("timestamp", "num_threads", "other_cores"))
    report["pagedserve_thread_changes"] = changes
    if changes:
        report["notes"].append("pagedserve's worker changed its thread count during the run (other processes used "
                               "the CPU): " + ", ".join(f"{change['timestamp']} to {change['num_threads']} (others "
                                                        f"{change['other_cores']} cores)" for change in changes))
    failures = serve_events(serve_log, "request_failed", ("timestamp", "code", "error"))
    report["pagedserve_request_failures"] = failures[:20]
    if any(point["systems"].get("pagedserve", {}).get("num_errored") for point in report["points"]) and failures:
        report["problems"].append(f"pagedserve's log, first failed request: {failures[0]['code']} {failures[0]['error']}")


def ratios(runs: dict[str, dict]) -> dict[str, float | None]:
    ours, theirs = runs.get("pagedserve"), runs.get("llama.cpp")
    if not ours or not theirs:
        return {}
    return {key: ours[key] / theirs[key] if theirs[key] else None for key in RATIO_COLUMNS.values()}


def summary_rows(entries: list[dict]) -> list[dict]:
    """A row per server and point, then the point's ratio row."""
    rows = []
    for entry in entries:
        for system, figures in entry["systems"].items():
            rows.append({"shape": entry["shape"], "streams": entry["concurrency"], "system": system,
                         "output tok/s": figures["output_tokens_per_second"], "req/s": figures["requests_per_second"],
                         "TTFT p50 ms": figures["ttft_p50_ms"], "TTFT p99 ms": figures["ttft_p99_ms"],
                         "ITL p50 ms": figures["itl_p50_ms"], "ITL p99 ms": figures["itl_p99_ms"],
                         "completed": figures["num_completed"]})
        if entry["ratios"]:
            rows.append({"shape": entry["shape"], "streams": entry["concurrency"], "system": "pagedserve / llama.cpp",
                         **{column: f"{entry['ratios'][key]:.2f}x" for column, key in RATIO_COLUMNS.items()
                            if entry["ratios"][key] is not None}})
    return rows


def kept_figures(report: dict) -> dict:
    """The report without the guidellm command of every point (the servers' commands stay)."""
    kept = {key: value for key, value in report.items() if key != "points"}
    kept["points"] = [{key: value for key, value in entry.items() if key != "guidellm_commands"}
                      for entry in report["points"]]
    return kept


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="256x64", help="PROMPTxOUTPUT tokens of every request, comma-separated")
    parser.add_argument("--concurrency", default="1,8,32", help="streams of the concurrent profile, comma-separated")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--duration", type=float, help="seconds per server and point (default 60)")
    budget.add_argument("--max-requests", type=int, help="requests per server and point, instead of --duration")
    parser.add_argument("--warmup-fraction", type=float, default=0.1,
                        help="share of each point's time (or requests) guidellm leaves out at its start and at its end")
    parser.add_argument("--seed", type=int, default=0, help="guidellm's seed of the first point (the next: +1, ...)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama-server's threads (pagedserve keeps its defaults)")
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument("--llama-args", default="", help='more llama-server flags, e.g. "--poll 0"')
    parser.add_argument("--guidellm", type=Path, default=default_guidellm())
    parser.add_argument("--guidellm-processes", type=int, default=1,
                        help="guidellm's worker processes (its default, up to 10, crowds a small CPU)")
    parser.add_argument("--no-keep", action="store_true", help="no copy in bench/results/kept/ (smoke runs)")
    args = parser.parse_args()
    try:
        args.shapes = [Shape.parse(text) for text in args.shapes.split(",") if text]
        args.concurrency = [int(value) for value in args.concurrency.split(",") if value]
        args.budget = (Budget(num_requests=args.max_requests) if args.max_requests is not None
                       else Budget(seconds=args.duration if args.duration is not None else 60.0))
    except ValueError as error:
        parser.error(str(error))
    args.systems = [system for system in args.systems.split(",") if system]
    if not args.systems or set(args.systems) - set(SYSTEMS):
        parser.error(f"--systems: a comma-separated subset of {', '.join(SYSTEMS)}")
    if not args.shapes or not args.concurrency or min(args.concurrency) < 1:
        parser.error("--shapes and --concurrency need at least one value, concurrencies positive")
    return args


def main() -> None:
    args = parse_args()
    if not args.guidellm.is_file():
        raise SystemExit(install_hint())
    notes = []
    if "llama.cpp" in args.systems and not args.llama_server.is_file():
        notes.append(f"llama.cpp skipped: no llama-server at {args.llama_server} (build it, or pass --llama-server "
                     f"or set $LLAMA_SERVER)")
        args.systems.remove("llama.cpp")
    if "OMP_NUM_THREADS" in os.environ:
        notes.append(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} is set: pagedserve's workers follow it")
    stamp = timestamp()
    log_dir = RESULTS_DIR / f"guidellm_chat-{stamp}-logs"
    gguf = ensure_smollm2()
    dtype = cpu_auto_dtype()
    sweep = Sweep(args.guidellm, tokenizer_folder(gguf, log_dir / "tokenizer"), args.budget, args.warmup_fraction,
                  args.guidellm_processes, log_dir)
    context_per_slot = CONTEXT_ROUND * math.ceil(max(shape.prompt_tokens + shape.output_tokens + CHAT_TEMPLATE_TOKENS
                                                     for shape in args.shapes) / CONTEXT_ROUND)
    points = [Point(shape, concurrency, args.seed + index) for index, (shape, concurrency)
              in enumerate((shape, concurrency) for shape in args.shapes for concurrency in args.concurrency)]
    report = {"machine": machine(), "date": stamp, "load_average_start": os.getloadavg(), "model": str(gguf),
              "tokenizer": str(sweep.tokenizer), "guidellm_version": guidellm_version(args.guidellm),
              "pagedserve_dtype": dtype, "sampling": SAMPLING, "budget": asdict(args.budget),
              "warmup_fraction": args.warmup_fraction, "guidellm_processes": args.guidellm_processes, "notes": notes}
    print(f"{report['machine']['cpu']}, {report['machine']['num_cores']} cores; guidellm {report['guidellm_version']}; "
          f"SmolLM2-135M-Instruct ({gguf.name}, pagedserve in {dtype}); {len(points)} point(s), "
          f"{args.budget.constraint()} per server and point; load average {os.getloadavg()[0]:.2f}", flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)
    started = time.perf_counter()
    with ExitStack() as stack:
        targets = start_targets(stack, args, gguf, dtype, context_per_slot, log_dir)
        report["commands"] = {system: target.command for system, target in targets.items()}
        report["points"], problems = run_sweep(targets, points, sweep)
    report["wall_seconds"] = time.perf_counter() - started
    report["load_average_end"] = os.getloadavg()
    report["problems"] = problems
    add_serve_log_findings(report, log_dir / "serve.log")
    print()
    print_table(summary_rows(report["points"]),
                title=f"guidellm, chat, {args.budget.constraint()} per server and point (pagedserve with its default "
                      f"flags; ratio = pagedserve / llama.cpp: tok/s above 1 and latency below 1 favour pagedserve)")
    for system, command in report["commands"].items():
        print(f"{system}: {command}")
    for line in [*notes, *problems]:
        print(f"note: {line}")
    paths = save_report(f"guidellm_chat-{stamp}", report)
    if not args.no_keep:
        paths += save_kept("guidellm_chat", kept_figures(report))
    print(f"load average {report['load_average_start'][0]:.2f} at the start, {report['load_average_end'][0]:.2f} "
          f"at the end; wrote {', '.join(map(str, paths))} ({report['wall_seconds']:.0f} s)")
    if problems:
        raise SystemExit(f"{len(problems)} problem(s): the figures above are not what was asked for")


if __name__ == "__main__":
    main()
