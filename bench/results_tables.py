"""Markdown tables of the latest (or given) benchmark results, for docs/performance.md.

    python bench/results_tables.py [--offline PATH] [--online PATH] [--overheads PATH] [--copy-plots DIR]

Reads bench/results/{offline,online,overheads}-*.json (the newest of each unless a path is
given) and prints their tables; --copy-plots copies the matching PNGs into DIR under fixed names.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from lib.output import markdown_table
from lib.workload import RESULTS_DIR

LABELS = {"pagedserve": "pagedserve `serve` (gRPC)", "hf-static": "HF `generate`, static batches of 16",
          "hf-cb": "HF `generate_batch` (continuous batching)"}


def newest(kind: str) -> Path | None:
    paths = sorted(RESULTS_DIR.glob(f"{kind}-*.json"))
    return paths[-1] if paths else None


def offline(report: dict) -> str:
    rows = []
    for dtype, entry in report["dtypes"].items():
        ours = entry["systems"].get("pagedserve", {}).get("tokens_per_second")
        for system, run in entry["systems"].items():
            ratio = f"{ours / run['tokens_per_second']:.2f}x" if ours and system != "pagedserve" else ""
            rows.append([dtype, LABELS[system], run["tokens_per_second"], run["seconds"], ratio])
    out = [markdown_table(["dtype", "system", "output tokens/s", "wall s", "pagedserve speed-up"], rows), ""]
    rows = []
    for dtype, entry in report["dtypes"].items():
        if "decode_phase" not in entry:
            continue
        steps = entry["systems"]["pagedserve"]["steps"]["decode_half_running"]
        rows.append([dtype, entry["roofline"]["peak_gflops"], entry["decode_phase"]["gflops_per_second"],
                     f"{100 * entry['mfu_decode']:.0f}%", entry["decode_phase_half_running"]["gflops_per_second"],
                     f"{100 * entry['mfu_decode_half_running']:.0f}%", f"{100 * steps['forward_share']:.0f}%",
                     f"{100 * entry['mfu_decode_half_running'] / max(steps['forward_share'], 1e-9):.0f}%",
                     entry["roofline"]["workload_seconds_at_peak"]])
    out.append(markdown_table(["dtype", "matmul GFLOP/s (peak)", "decode phase GFLOP/s", "MFU",
                      "≥ half running GFLOP/s", "MFU", "forward share of those steps",
                      "MFU inside the forward (est.)", "workload at peak, s"], rows))
    return "\n".join(out)


def online(report: dict) -> str:
    rows = [[row["rate"], row["output_tokens_per_second"],
             *(row["ttft_ms"][p] for p in ("p50", "p90", "p99")),
             *(row["itl_ms"][p] for p in ("p50", "p90", "p99")),
             *(row["latency_s"][p] for p in ("p50", "p90", "p99"))] for row in report["rates"]]
    out = [markdown_table(["requests/s", "output tok/s", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "p90", "p99",
                  "E2E p50 s", "p90", "p99"], rows), ""]
    rows = [[run["max_num_batched_tokens"], run["decode_itl_ms"]["p50"], run["decode_itl_ms"]["p99"],
             run["decode_itl_ms"]["max"], run["decode_itl_during_long_prefill_ms"]["p50"],
             run["decode_itl_during_long_prefill_ms"]["max"], run["long_prompt_ttft_s"]["p50"]]
            for run in report["chunked_prefill"]]
    out.append(markdown_table(["step budget (tokens)", "decode ITL p50 ms", "p99 ms", "max ms",
                      "ITL while long prompts prefill, p50 ms", "max ms", "long-prompt TTFT p50 s"], rows))
    return "\n".join(out)


def overheads(report: dict) -> str:
    out = [markdown_table(["running sequences", "schedule() ms", "process_result() ms", "scheduler ms per step"],
                 [[r["num_seqs"], f"{r['schedule_ms']:.3f}", f"{r['process_result_ms']:.3f}", f"{r['step_ms']:.3f}"]
                  for r in report["scheduler"]]), ""]
    codec = report["codec"]
    out.append(markdown_table(["sequences", "plan bytes", "plan encode ms", "plan decode ms", "result bytes",
                      "result encode ms", "result decode ms"],
                     [[codec["num_seqs"], codec["plan_bytes"], f"{codec['plan_encode_ms']:.3f}",
                       f"{codec['plan_decode_ms']:.3f}", codec["result_bytes"], f"{codec['result_encode_ms']:.3f}",
                       f"{codec['result_decode_ms']:.3f}"]]))
    out.append("")
    step = report["serving_step"]
    parts = ["schedule", "plan_codec", "build_inputs", "sample", "execute_other", "result_codec", "process_result"]
    out.append(markdown_table(["forward ms", *parts, "outside the forward ms"],
                     [[f"{step['forward_ms']:.2f}", *(f"{step[f'{p}_ms']:.2f}" for p in parts),
                       f"{step['outside_forward_ms']:.2f}"]]))
    serve = report.get("serve")
    if serve:
        out.append("")
        roles = sorted(key.removesuffix("_cpu_us_per_token") for key in serve if key.endswith("_cpu_us_per_token"))
        out.append(markdown_table(["step ms", "forward ms", "outside the forward ms",
                          *(f"{role} CPU µs/token" for role in roles)],
                         [[f"{serve['step_ms']:.1f}", f"{serve['forward_ms']:.1f}", f"{serve['outside_forward_ms']:.1f}",
                           *(f"{serve[f'{role}_cpu_us_per_token']:.0f}" for role in roles)]]))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", type=Path)
    parser.add_argument("--online", type=Path)
    parser.add_argument("--overheads", type=Path)
    parser.add_argument("--copy-plots", type=Path, help="folder for performance-{offline,online,overheads}.png")
    args = parser.parse_args()
    for kind, render in (("offline", offline), ("online", online), ("overheads", overheads)):
        path = getattr(args, kind) or newest(kind)
        if path is None:
            continue
        report = json.loads(path.read_text())
        print(f"### {kind} ({path.name})\n")
        print(render(report))
        print()
        if args.copy_plots and path.with_suffix(".png").exists():
            args.copy_plots.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path.with_suffix(".png"), args.copy_plots / f"performance-{kind}.png")


if __name__ == "__main__":
    main()
