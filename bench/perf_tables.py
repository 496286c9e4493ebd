"""docs/performance-tables.md from the result files kept in git (bench/results/kept/).

    python bench/perf_tables.py [--out docs/performance-tables.md]      (or: make perf-tables)

A kept result is one small JSON per run, named <kind>-<UTC date>-<cpu>.json, holding the CPU
model (machine.cpu), the load average and the figures (bench/roofline.py, bench/real_model.py
and bench/guidellm_chat.py write them; any bench may, through `save_kept`). Every table here
names its CPU and the dates of the runs it summarises; a figure over several runs of one CPU is
their median (never the best run), with the number of runs beside it. A run that started at a
load average above its machine's core count measured the share of the cores it got, not the CPU:
such runs are left out of a table (and named under it) unless every run of the table was one.
Nothing in the page is typed by hand: rerun this after adding a result.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
KEPT = BENCH / "results" / "kept"
DEFAULT_OUT = BENCH.parent / "docs" / "performance-tables.md"


def cpu_slug(cpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")[:48] or "unknown-cpu"


def kept_name(kind: str, report: dict) -> str:
    return f"{kind}-{report['date']}-{cpu_slug(report['machine']['cpu'])}.json"


def save_kept(kind: str, report: dict, folder: Path = KEPT) -> list[Path]:
    """Writes report (with "date" and "machine") as folder/<kind>-<date>-<cpu>.json; returns [path]."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / kept_name(kind, report)
    path.write_text(json.dumps({"kind": kind, **report}, indent=2) + "\n")
    return [path]


def load_kept(folder: Path = KEPT) -> dict[str, dict[str, list[dict]]]:
    """{kind: {cpu: [reports, oldest first]}}."""
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(folder.glob("*.json")):
        report = json.loads(path.read_text())
        kind = report.get("kind") or path.name.split("-", 1)[0]
        out[kind][report["machine"]["cpu"]].append(report)
    return out


def _median(values: list[float]) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def _dates(reports: list[dict]) -> str:
    days = sorted({report["date"][:8] for report in reports})
    dates = ", ".join(f"{day[:4]}-{day[4:6]}-{day[6:]}" for day in days)
    loads = [report.get("load_average_start", [None])[0] for report in reports]
    loads = [load for load in loads if load is not None]
    load = f"; load average at the start {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    with_commit = [report["machine"]["commit"] for report in reports if report.get("machine", {}).get("commit")]
    code = f"; code {', '.join(sorted(set(with_commit)))}" if with_commit else ""
    if with_commit and len(with_commit) < len(reports):
        code += f" ({len(with_commit)} of the {len(reports)} runs recorded their commit)"
    return f"{len(reports)} run(s) on {dates}{load}{code}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def limits_section(cpu: str, reports: list[dict]) -> list[str]:
    dtypes = sorted({dtype for report in reports for dtype in report["gemm_gflops"]})
    rows = [["read bandwidth (GB/s)", _fmt(_median([report["read_gb_per_s"] for report in reports]))]]
    for dtype in dtypes:
        for num_rows in ("1", "32", "512"):
            values = [report["gemm_gflops"].get(dtype, {}).get(num_rows) for report in reports]
            rows.append([f"GEMM {dtype}, {num_rows} rows (GFLOP/s)", _fmt(_median(values))])
    threads = sorted({report["num_threads"] for report in reports})
    return [f"### Limits: {cpu}", "", f"bench/roofline.py, {'/'.join(map(str, threads))} threads; {_dates(reports)}; "
            "medians.", "", *_table(["limit", "median"], rows), ""]


def _real_model_system(system: str, config: str) -> str:
    """Runs kept before pagedserve was also asked for whole answers measured it over GenerateStream
    only, under the name "pagedserve": they count as "pagedserve-stream"."""
    return "pagedserve-stream" if system == "pagedserve" and "unary Generate" not in config else system


def _real_model_rates(report: dict):
    """(dtype, streams, system, tokens/s, the run's limit in tokens/s or None) for every figure of a
    real_model report, the systems named as _real_model_system names them. The limit is the one
    measured at the run's start, or for a one-stream figure that kept the bandwidth sampled between
    its own requests (bench/real_model.py), that bandwidth's."""
    for dtype, entry in report["dtypes"].items():
        for system, runs in entry["systems"].items():
            system = _real_model_system(system, entry.get("configs", {}).get(system, ""))
            for streams, run in runs.items():
                limit = entry.get("token_limits", {}).get(str(streams))
                if "read_gb_per_s" in run:  # the bandwidth sampled between this system's own requests
                    limit = run["read_gb_per_s"] * 1e9 / entry["weight_bytes_per_token"]
                yield dtype, int(streams), system, run["tokens_per_second"], limit


def real_model_section(cpu: str, reports: list[dict]) -> list[str]:
    configs = sorted({f"{dtype}, {_real_model_system(system, config)}: {config}" for report in reports
                      for dtype, entry in report["dtypes"].items()
                      for system, config in entry.get("configs", {}).items()})
    extra = sorted({" ".join(report.get("serve_args", [])) for report in reports} - {""})
    values: dict[tuple, list[float]] = defaultdict(list)
    shares: dict[tuple, list[float]] = defaultdict(list)
    for report in reports:
        for dtype, streams, system, rate, limit in _real_model_rates(report):
            values[(dtype, streams, system)].append(rate)
            if limit:
                shares[(dtype, streams, system)].append(rate / limit)
    systems = sorted({key[2] for key in values}, key=lambda name: (not name.startswith("pagedserve"), name))
    rows = []
    for dtype, streams in sorted({key[:2] for key in values}):
        row = [dtype, str(streams)]
        for system in systems:
            value = _median(values.get((dtype, streams, system), []))
            share = _median(shares.get((dtype, streams, system), []))
            row.append(_fmt(value) + (f" ({100 * share:.0f} %)" if share is not None else ""))
        rows.append(row)
    return [*real_model_latest_section(cpu, reports), f"### SmolLM2-135M-Instruct output tokens/s: {cpu}", "",
            f"bench/real_model.py; {_dates(reports)}; medians, in brackets the share of this CPU's limit (1 stream: "
            "read bandwidth / weight bytes per token, the bandwidth sampled between the system's own requests where "
            "the run kept it, else the run's start; 32 streams: GEMM peak at 32 rows / FLOPs per token).", "",
            *_table(["dtype", "streams", *systems], rows), "",
            *(f"- {config}" for config in configs),
            *(f"- extra serve flags: {' / '.join(extra)}" for _ in extra[:1]), ""]


PEERS = ("llama.cpp", "llama.cpp-poll0")


NOT_CODE = ("bench/results", "docs", "tests", "README.md")


@functools.lru_cache(maxsize=None)
def code_revision(commit: str) -> str:
    """The newest commit at or before `commit` that changed more than results, docs and tests: the
    code a run at `commit` measured. The commit itself where git cannot tell (not in this
    repository, or a tree with uncommitted changes: "<commit>+changes")."""
    if "+" in commit:
        return commit
    try:
        found = subprocess.run(["git", "rev-list", "-1", "--abbrev-commit", "--abbrev=7", commit, "--", ".",
                                *(f":(exclude){path}" for path in NOT_CODE)],
                               cwd=BENCH.parent, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return commit
    return found.stdout.strip() if found.returncode == 0 and found.stdout.strip() else commit


def latest_code(reports: list[dict]) -> tuple[list[dict], str | None]:
    """The runs that measured the newest run's code (code_revision), and that revision (([], None)
    when the newest run recorded no commit)."""
    commit = reports[-1].get("machine", {}).get("commit") if reports else None
    if not commit:
        return [], None
    code = code_revision(commit)
    return [report for report in reports if report.get("machine", {}).get("commit")
            and code_revision(report["machine"]["commit"]) == code], code


def real_model_latest_section(cpu: str, reports: list[dict]) -> list[str]:
    """Whole answers against llama.cpp's better config at the newest code only: medians of the
    runs, and the median of the ratios measured within each run (the figure the targets use)."""
    runs, commit = latest_code(reports)
    values: dict[tuple, list[float]] = defaultdict(list)
    shares: dict[tuple, list[float]] = defaultdict(list)
    peers: dict[tuple, list[float]] = defaultdict(list)
    ratios: dict[tuple, list[float]] = defaultdict(list)
    for report in runs:
        rates = {(dtype, streams, system): (rate, limit)
                 for dtype, streams, system, rate, limit in _real_model_rates(report)}
        for (dtype, streams, system), (rate, limit) in rates.items():
            best = max((rates[(dtype, streams, peer)][0] for peer in PEERS if (dtype, streams, peer) in rates),
                       default=None)
            if system != "pagedserve" or best is None:
                continue
            key = (dtype, streams)
            values[key].append(rate)
            peers[key].append(best)
            ratios[key].append(rate / best)
            if limit:
                shares[key].append(rate / limit)
    if not ratios:
        return []
    rows = []
    for key in sorted(ratios):
        share = _median(shares.get(key, []))
        rows.append([key[0], str(key[1]), _fmt(_median(values[key])) + (f" ({100 * share:.0f} %)" if share else ""),
                     _fmt(_median(peers[key])), f"{_median(ratios[key]):.2f}x",
                     ", ".join(f"{ratio:.2f}" for ratio in ratios[key]), str(len(ratios[key]))])
    return [f"### The newest code measured ({commit}): pagedserve whole answers against llama.cpp, {cpu}", "",
            f"The runs of bench/real_model.py that measured the code of commit {commit} (later commits changed only "
            "results, docs or tests); medians, and the median of the ratios measured within each run against the "
            "better of llama.cpp's two configs.", "",
            *_table(["dtype", "streams", "pagedserve (share of limit)", "llama.cpp best", "ratio (median)",
                     "ratio per run", "runs"], rows), "", *_after_first_token_section(runs)]


def _after_first_token_section(runs: list[dict]) -> list[str]:
    """One stream after each request's first token (bench/real_model.py's steady_tokens_per_second),
    where the runs kept it: pagedserve against the better of llama.cpp's configs, each against the
    bandwidth sampled between its own requests."""
    values: dict[tuple, list[float]] = defaultdict(list)
    peers: dict[tuple, list[float]] = defaultdict(list)
    shares: dict[tuple, list[float]] = defaultdict(list)
    peer_shares: dict[tuple, list[float]] = defaultdict(list)
    ratios: dict[tuple, list[float]] = defaultdict(list)
    for report in runs:
        for dtype, entry in report["dtypes"].items():
            def steady(system: str, streams: str):
                run = entry["systems"].get(system, {}).get(streams, {})
                rate = run.get("steady_tokens_per_second")
                limit = (run["read_gb_per_s"] * 1e9 / entry["weight_bytes_per_token"]
                         if rate and "read_gb_per_s" in run and "weight_bytes_per_token" in entry else None)
                return rate, limit

            for streams in entry["systems"].get("pagedserve", {}):
                ours, our_limit = steady("pagedserve", streams)
                theirs = max((pair for pair in (steady(peer, streams) for peer in PEERS) if pair[0]), default=None)
                if not ours or not theirs:
                    continue
                key = (dtype, int(streams))
                values[key].append(ours)
                peers[key].append(theirs[0])
                ratios[key].append(ours / theirs[0])
                if our_limit:
                    shares[key].append(ours / our_limit)
                if theirs[1]:
                    peer_shares[key].append(theirs[0] / theirs[1])
    if not ratios:
        return []

    def with_share(value: float, share: float | None) -> str:
        return _fmt(value) + (f" ({100 * share:.0f} %)" if share else "")

    rows = [[key[0], str(key[1]), with_share(_median(values[key]), _median(shares.get(key, []))),
             with_share(_median(peers[key]), _median(peer_shares.get(key, []))), f"{_median(ratios[key]):.2f}x",
             ", ".join(f"{ratio:.2f}" for ratio in ratios[key]), str(len(ratios[key]))] for key in sorted(ratios)]
    return ["The same runs after each request's first token (the steady state the bandwidth bounds: every output "
            "token but the first over the requests' times less each server's own time for their prompts), "
            "each system against the bandwidth sampled between its own requests.", "",
            *_table(["dtype", "streams", "pagedserve after the first token (share)", "llama.cpp best (share)",
                     "ratio (median)", "ratio per run", "runs"], rows), ""]


def generic_section(kind: str, cpu: str, reports: list[dict]) -> list[str]:
    latest = reports[-1]
    rows = latest.get("rows")
    if not rows:
        return []
    header = list(rows[0])
    body = [[_fmt(row[name], 4 if abs(row[name]) < 1 else 2) if isinstance(row[name], float) else str(row[name])
             for name in header] for row in rows]
    notes = "; ".join(str(latest[key]) if key == "note" else f"{key} {latest[key]}"
                      for key in ("threads", "note") if latest.get(key) is not None)
    return [f"### {kind}: {cpu}", "", f"bench/{kind}.py, the latest of {_dates(reports)}" + (f" ({notes})" if notes else "")
            + ".", "", *_table(header, body), ""]


def gguf_greedy_section(cpu: str, reports: list[dict]) -> list[str]:
    rows = [[report["date"], Path(report["gguf"]).name, report["dtype"], str(report["new_tokens"]),
             f"{report['num_identical']} of {len(report['rows'])}"] for report in reports]
    return [f"### GGUF greedy answers, blocks kept (--quantization auto) against dequantized (none): {cpu}", "",
            f"bench/gguf_greedy.py on bench/quant_accuracy.py's chat prompts; {_dates(reports)}; every run.", "",
            *_table(["run", "file", "dtype", "tokens per prompt", "identical continuations"], rows), ""]


def _command_shape(command: str) -> str:
    """A server's command line without what changes from run to run: ports, host, folders."""
    command = re.sub(r" --(?:http-|scheduler-)?port \d+| --host \S+", "", command)
    return " ".join(Path(word).name if "/" in word else word for word in command.split())


def guidellm_chat_section(cpu: str, reports: list[dict]) -> list[str]:
    """A row per shape and concurrency: medians over the runs. A server that completed no request
    within a point has no figures there (guidellm's zeros are not times), nor has the point a ratio."""
    values: dict[tuple, list[float]] = defaultdict(list)  # (prompt, output, streams, system, figure) -> runs
    incomplete: dict[tuple, int] = defaultdict(int)  # (prompt, output, streams, system) -> runs
    for report in reports:
        for point in report["points"]:
            key = (point["prompt_tokens"], point["output_tokens"], point["concurrency"])
            for system, figures in point["systems"].items():
                if figures.get("num_completed", 1) == 0:
                    incomplete[(*key, system)] += 1
                    continue
                for figure in ("output_tokens_per_second", "ttft_p50_ms", "itl_p50_ms"):
                    values[(*key, system, figure)].append(figures[figure])
            ratio = (point.get("ratios") or {}).get("output_tokens_per_second")
            if ratio is not None and all(figures.get("num_completed", 1) for figures in point["systems"].values()):
                values[(*key, "ratio", "output_tokens_per_second")].append(ratio)

    def median(key: tuple, system: str, figure: str, digits: int = 1) -> str:
        return _fmt(_median(values.get((*key, system, figure), [])), digits)

    rows = []
    for key in sorted({key[:3] for key in values} | {key[:3] for key in incomplete}):
        ratio = _median(values.get((*key, "ratio", "output_tokens_per_second"), []))
        rows.append([f"{key[0]}x{key[1]}", str(key[2]), median(key, "pagedserve", "output_tokens_per_second"),
                     median(key, "llama.cpp", "output_tokens_per_second"), "" if ratio is None else f"{ratio:.2f}x",
                     f"{median(key, 'pagedserve', 'ttft_p50_ms', 0)} / {median(key, 'llama.cpp', 'ttft_p50_ms', 0)}",
                     f"{median(key, 'pagedserve', 'itl_p50_ms')} / {median(key, 'llama.cpp', 'itl_p50_ms')}"])
    commands = sorted({f"{system}: {_command_shape(command)}" for report in reports
                       for system, command in report.get("commands", {}).items()})
    budgets = sorted({", ".join(f"{name} {value:g}" for name, value in report["budget"].items() if value is not None)
                      + f" per server and point, guidellm {report.get('guidellm_version', '?')}" for report in reports})
    return [f"### guidellm chat against llama.cpp, SmolLM2-135M-Instruct: {cpu}", "",
            f"bench/guidellm_chat.py (shapes: prompt x output tokens; streams: guidellm's concurrency); "
            f"{_dates(reports)}; medians; ratio = pagedserve / llama.cpp output tokens/s.", "",
            *_table(["shape", "streams", "pagedserve tok/s", "llama.cpp tok/s", "ratio",
                     "TTFT p50 ms (pagedserve / llama.cpp)", "ITL p50 ms (pagedserve / llama.cpp)"], rows), "",
            *(f"- {command}" for command in commands), *(f"- {budget}" for budget in budgets),
            *(f"- {system} at {prompt}x{output}, {streams} streams: no request completed within the point in "
              f"{count} of the runs (no figures)" for (prompt, output, streams, system), count in sorted(incomplete.items())),
            ""]


SECTIONS = {"limits": limits_section, "real_model": real_model_section, "gguf_greedy": gguf_greedy_section,
            "guidellm_chat": guidellm_chat_section}


def is_loaded(report: dict) -> bool:
    """The run started at a load average above its machine's core count (another job was running)."""
    load = report.get("load_average_start", [None])[0]
    cores = report.get("machine", {}).get("num_cores")
    return load is not None and bool(cores) and load > cores


def quiet_runs(reports: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the runs a table summarises, the loaded runs left out): every run when all were loaded."""
    quiet = [report for report in reports if not is_loaded(report)]
    return (quiet, [report for report in reports if is_loaded(report)]) if quiet else (reports, [])


def render(kept: dict[str, dict[str, list[dict]]]) -> str:
    lines = ["# Performance tables", "",
             "Generated by `make perf-tables` (bench/perf_tables.py) from the result files in bench/results/kept/; "
             "do not edit by hand. What the figures mean and what limits them: docs/cpu-limits.md.", ""]
    for kind in sorted(kept, key=lambda name: (name not in SECTIONS, list(SECTIONS).index(name) if name in SECTIONS
                                               else 0, name)):
        for cpu, reports in sorted(kept[kind].items()):
            section = SECTIONS.get(kind)
            used, left_out = quiet_runs(reports)
            lines += section(cpu, used) if section else generic_section(kind, cpu, used)
            if left_out:
                lines += [f"Left out, started on a busy machine (load average above the core count): "
                          f"{', '.join(report['date'] for report in left_out)}.", ""]
    toc = [f"- [{line[4:]}](#{anchor(line[4:])})" for line in lines if line.startswith("### ")]
    lines[4:4] = ["<!-- toc -->", *toc, "<!-- /toc -->", ""]
    return "\n".join(lines).rstrip() + "\n"


def anchor(title: str) -> str:
    """GitHub's anchor of a heading (lower case, punctuation dropped, spaces to hyphens), for the
    table of contents."""
    title = re.sub(r"[`*]", "", title.strip().lower())
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--kept", type=Path, default=KEPT)
    args = parser.parse_args()
    args.out.write_text(render(load_kept(args.kept)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
