"""The real model against its real peers: pagedserve, Hugging Face transformers and llama.cpp's
llama-server on SmolLM2-135M-Instruct, in one run.

    python bench/real_model.py [--dtypes float32,bfloat16,q4_1] [--streams 1,32]
                               [--systems pagedserve,pagedserve-stream,hf,llama.cpp,llama.cpp-poll0]
                               [--threads 2] [--num-single-requests 4] [--llama-server PATH]

Workload: the 32 chat prompts of bench/data/quant_prompts.json through the model's chat template
(37-80 tokens), output lengths uniform in 48-128 (seed 0), greedy, EOS ignored, so every system
produces exactly the requested tokens. "32 streams": all 32 requests at once; "1 stream": the
first --num-single-requests requests one after another (to pagedserve over one gRPC channel, its
step records read between requests: a read during a decode run would end the run). Every
system gets the same weights in the same precision: for D = float32 and bfloat16 the Q4_1 GGUF
dequantized, for D = q4_1 the GGUF as it is (pagedserve and llama.cpp; HF has no Q4_1 kernels and is not run):

    pagedserve   `pagedserve serve --model smollm2 --dtype D --quantization none`, for q4_1
                 `pagedserve serve --model smollm2 --quantization auto` (the GGUF's Q4_1 linear
                 weights kept as int4, --dtype auto activations); nothing else: its DEFAULT flags
                 (threads, batch sizes, KV pool); requests over unary Generate (gRPC), token ids
                 in, the whole answer at the end, as llama.cpp's and HF's below are asked
    pagedserve-stream  the same, over GenerateStream: a message per token to the client, whose
                 CPU shares the machine; its token times give the 32-stream decode phase
    hf           transformers `generate` on the GGUF's weights dequantized once into a float32
                 folder (cached), loaded in D, --threads torch threads; 32 streams = one static batch of 32, left-padded, run to the longest
                 output (only requested tokens count); 1 stream = batch 1
    llama.cpp    `llama-server -t T -tb T -np S -c S*256` on the GGUF dequantized to D
                 (bench/lib/gguf_convert.py; F32 or BF16 weights, its default F16 KV cache), for
                 q4_1 on the GGUF itself;
                 `/completion` with token-id prompts, n_predict, ignore_eos, temperature 0,
                 stream false (the whole answer at the end).
                 Twice: with its defaults (its threads spin-wait: --poll 50) and with --poll 0
                 (they sleep), the better of the two is the "llama.cpp best" the targets use.
                 Skipped, with a note, when the binary is not found (--llama-server or
                 $LLAMA_SERVER, default: the build under ~/.cache/pagedserve/llama.cpp)

HF's torch threads spin briefly between parallel regions (GOMP_SPINCOUNT as `pagedserve worker`
sets for itself, worker/cpu_share.py; HF keeps two threads throughout); the serve processes get
the worker's own default (the variable is passed to them empty). llama.cpp keeps its own thread
pool's defaults.

Output tokens/s = requested output tokens / wall time from the first submission to the last
token; for one stream, the sum of the requests' own times (from sending each to its last token).
Every figure is also given as a share of this CPU's limits, measured at the start of the run
(bench/roofline.py: read bandwidth and GEMM peaks): 1 stream against read bandwidth / weight bytes
per token (the GGUF's size for q4_1), 32 streams against the GEMM peak at 32 rows / 2 x parameters
FLOPs per token. The read bandwidth of a shared host changes within seconds (docs/cpu-limits.md:
34-38 and 63-65 GB/s on one AMD EPYC), so each system's one-stream requests are also separated by
short samples of it (the best of a few passes over 1 GiB: one 0.05 s after a request, another
after 3.2 s without one, right before the next; sampling()), and its one-stream share is taken
against the mean of the samples before, between and after its requests: the bandwidth that system
met. The worker's changes of its thread count (worker/cpu_share.py) are kept as notes. The figures and limits are also kept in bench/results/kept/ (make
perf-tables).
One stream also gives the rate after each request's first token (the steady state the bandwidth
limit bounds: a prompt's prefill is bound by the GEMM peak instead): every output token but the
first over the requests' times less each server's own time for their prompt phase, measured the
same way for every server: llama.cpp's `timings.prompt_ms` (slot start to the prompt's last batch),
pagedserve's step records of the steps that computed prompt tokens (schedule to processed result).
Everything else in a request's time (the client, the transport, the first token's delivery)
counts as decode time for both.
The roofline (bench/roofline.py on SmolLM2's shapes, --threads threads) gives the model
FLOP utilization of pagedserve-stream's 32-stream decode phase. The targets and ratios compare
"pagedserve" (whole answers) with llama.cpp (whole answers). Targets (issue "Performance on a real
model"): 32 streams >= 1.5x llama.cpp and >= 1.5x HF, >= 75 % of the roofline in decode-heavy
steps; 1 stream >= 1.0x llama.cpp. A table goes to stdout, JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

# HF runs in this process: its OpenMP threads spin as briefly as pagedserve's workers do by default
# (worker/cpu_share.py); serve's children get the variable empty, so the worker applies its default
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

import torch  # noqa: E402

from lib.gguf_convert import convert_gguf  # noqa: E402
from lib.llama_server import default_llama_server, start_llama_server
from lib.machine_info import machine
from lib.one_stream import prefill_seconds, sampling, timed
from offline_throughput import decode_phase, step_summary
from lib.output import RESULTS_DIR, print_table, save_report, timestamp
from pagedserve.checkpoints.smollm2 import ensure_smollm2
from pagedserve.launch.serve_process import ServeProcess
from perf_tables import save_kept
from roofline import BandwidthProbe, measure_limits, measure_matmul, token_limits
from lib.step_recorder import StepRecorder
from lib.stream_client import run_requests
from lib.workload import BenchRequest, ModelShape

DATA = Path(__file__).resolve().parent / "data"
SMOLLM2 = ModelShape(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                     vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
SYSTEMS = ("pagedserve", "pagedserve-stream", "hf", "llama.cpp", "llama.cpp-poll0")
PAGEDSERVE = {"pagedserve": True, "pagedserve-stream": False}  # system -> whole answers (unary Generate)
LLAMA_ARGS = {"llama.cpp": [], "llama.cpp-poll0": ["--poll", "0"]}  # --poll 0: its threads wait without spinning
OUTPUT_LENS = (48, 128)
CONTEXT_PER_SLOT = 256
TARGETS = {32: {"llama.cpp best": 1.5, "hf": 1.5}, 1: {"llama.cpp best": 1.0}}
QUANTIZED = "q4_1"  # the GGUF's own format: no dequantization, no HF run, no roofline
ROOFLINE_TARGET = 0.75
WARMUP_TOKENS = 8


def make_workload(gguf: Path, seed: int = 0) -> list[BenchRequest]:
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    rng = random.Random(seed)
    requests = []
    for text in json.loads((DATA / "quant_prompts.json").read_text()):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        requests.append(BenchRequest(list(ids), rng.randint(*OUTPUT_LENS)))
    return requests


def run_pagedserve(dtype: str, workloads: dict[int, tuple[list[BenchRequest], bool]], log_dir: Path,
                   serve_args: list[str], whole: bool, probe: BandwidthProbe) -> dict:
    precision_args = ["--quantization", "auto"] if dtype == QUANTIZED else ["--dtype", dtype, "--quantization", "none"]
    results = {"config": " ".join(["pagedserve serve --model smollm2", *precision_args, *serve_args])
               + ("; unary Generate (whole answers)" if whole else "; GenerateStream")}
    log_path = log_dir / f"serve-{dtype}{'' if whole else '-stream'}.log"
    with ServeProcess("smollm2", log_path, [*precision_args, *serve_args], env={"GOMP_SPINCOUNT": ""}) as server:
        run_requests(server.address, [BenchRequest(workloads[max(workloads)][0][0].prompt_token_ids, WARMUP_TOKENS)],
                     whole=whole)
        for streams, (requests, concurrent) in workloads.items():
            # one stream: the step records are read between requests, not during a decode run
            with StepRecorder(server, interval=0.5 if concurrent else None) as recorder:
                if concurrent:
                    traces = run_requests(server.address, requests, whole=whole)
                else:
                    traces = run_requests(server.address, requests, whole=whole, sequential=True,
                                          on_done=sampling(probe, recorder.collect))
            results[streams] = timed(traces, None if concurrent else probe,
                                     None if concurrent else prefill_seconds(list(recorder.records.values())))
            results[streams]["steps"] = step_summary(list(recorder.records.values()), len(requests))
            if concurrent and len(requests) > 1 and not whole:
                results[streams]["decode_phase"] = decode_phase(traces, SMOLLM2)
    results["thread_changes"] = thread_changes(log_path)
    return results


def thread_changes(log_path: Path) -> list[dict]:
    """The worker's changes of its thread count (worker/cpu_share.py) in a serve log: a run in
    which it dropped to one thread measured that, not the kernels."""
    changes = []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"cpu_threads_changed"' in line:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            changes.append({key: event.get(key) for key in ("timestamp", "num_threads", "other_cores")})
    return changes


def hf_folder(gguf: Path) -> Path:
    """A plain float32 Hugging Face folder of the GGUF's weights (transformers keeps a GGUF's
    weights packed and dequantizes them in every matmul); built once into the cache."""
    from pagedserve.testing.hf_from_gguf import cached_hf_folder

    return cached_hf_folder(gguf)


def run_hf(gguf: Path, dtype: str, workloads: dict[int, tuple[list[BenchRequest], bool]]) -> dict:
    from offline_throughput import _static_batch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder(gguf), dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    results = {"config": f"transformers generate, {dtype}, {torch.get_num_threads()} torch threads, "
                         f"32 streams: one static batch of 32 (left-padded), 1 stream: batch 1"}
    _static_batch(model, [BenchRequest(workloads[max(workloads)][0][0].prompt_token_ids, WARMUP_TOKENS)])
    for streams, (requests, concurrent) in workloads.items():
        batches = [requests] if concurrent else [[request] for request in requests]
        start = time.perf_counter()
        for batch in batches:
            _static_batch(model, batch)
        seconds = time.perf_counter() - start
        num_tokens = sum(request.max_tokens for request in requests)
        results[streams] = {"seconds": seconds, "num_output_tokens": num_tokens,
                            "tokens_per_second": num_tokens / seconds, "load_average": os.getloadavg()[0]}
    return results


def run_llama_cpp(binary: Path, gguf: Path, dtype: str, threads: int,
                  workloads: dict[int, tuple[list[BenchRequest], bool]], log_dir: Path,
                  extra_args: list[str], probe: BandwidthProbe) -> dict:
    converted = gguf if dtype == QUANTIZED else convert_gguf(gguf, dtype)
    results = {}
    for streams, (requests, concurrent) in workloads.items():
        name = "-".join(["llama-server", dtype, str(streams), *[arg.strip("-") for arg in extra_args]])
        server = start_llama_server(binary, converted, log_dir / f"{name}.log", num_slots=streams,
                                    context_per_slot=CONTEXT_PER_SLOT, num_threads=threads, extra_args=extra_args)
        if "--no-repack" in server.command and "--no-repack" not in extra_args:
            extra_args = [*extra_args, "--no-repack"]  # for the next streams and the config line
        with server:
            server.run([BenchRequest(requests[0].prompt_token_ids, WARMUP_TOKENS)])
            if concurrent:
                results[streams] = timed(server.run(requests))
            else:
                traces = server.run(requests, concurrent=False, on_done=sampling(probe))
                results[streams] = timed(traces, probe, sum(trace.prompt_seconds for trace in traces)
                                         if all(trace.prompt_seconds > 0 for trace in traces) else None)
    results["config"] = (f"llama-server -m {converted.name} -t {threads} -tb {threads} -np S -c S*{CONTEXT_PER_SLOT} "
                         f"{' '.join(extra_args)} (S = streams; F16 KV cache, its default)").replace("  ", " ")
    return results


def run_limit(entry: dict, system: str, streams: int) -> float | None:
    """The one-stream tokens/s limit of the bandwidth measured between the system's own requests."""
    run = entry["systems"].get(system, {}).get(streams, {})
    if "read_gb_per_s" not in run:
        return None
    return run["read_gb_per_s"] * 1e9 / entry["weight_bytes_per_token"]


def summary_rows(report: dict) -> list[dict]:
    rows = []
    for dtype, entry in report["dtypes"].items():
        for streams in report["streams"]:
            row = {"dtype": dtype, "streams": streams}
            for system in SYSTEMS:
                run = entry["systems"].get(system, {}).get(streams)
                row[system] = run["tokens_per_second"] if run else ""
            ours = row["pagedserve"]
            llama_runs = [name for name in LLAMA_ARGS if row[name]]
            best_llama = max(llama_runs, key=lambda name: row[name]) if llama_runs else None
            row["llama.cpp best"] = row[best_llama] if best_llama else ""  # its better configuration in this run
            for peer, target in TARGETS.get(streams, {}).items():
                if ours and row[peer]:
                    ratio = ours / row[peer]
                    row[f"vs {peer}"] = f"{ratio:.2f}x (target {target}x: {'met' if ratio >= target else 'NOT met'})"
            limit = entry.get("token_limits", {}).get(str(streams))
            if limit:
                row["limit tok/s"] = limit
                for label, system in (("pagedserve", "pagedserve"), ("llama.cpp", best_llama)):
                    rate = row[system] if system else ""
                    own = run_limit(entry, system, streams) if rate else None
                    row[f"{label} % of limit"] = f"{100 * rate / (own or limit):.0f}%" if rate else ""
                for label, system in (("pagedserve", "pagedserve"), ("llama.cpp", best_llama)):
                    run = entry["systems"].get(system, {}).get(streams, {}) if system else {}
                    own = run_limit(entry, system, streams) if system else None
                    if run.get("steady_tokens_per_second") and own:
                        steady = run["steady_tokens_per_second"]
                        row[f"{label} after 1st token"] = f"{steady:.1f} ({100 * steady / own:.0f}%)"
            mfu = entry.get("mfu_decode", {}).get(streams)
            if mfu is not None:
                row["roofline"] = (f"{100 * mfu:.0f}% (target {100 * ROOFLINE_TARGET:.0f}%: "
                                   f"{'met' if mfu >= ROOFLINE_TARGET else 'NOT met'})")
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default=f"float32,bfloat16,{QUANTIZED}")
    parser.add_argument("--streams", default="1,32", help="1 and/or the number of requests sent at once")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of HF and llama.cpp (pagedserve keeps its defaults)")
    parser.add_argument("--num-single-requests", type=int, default=4, help="requests of the 1-stream runs")
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for pagedserve serve (the table is then not 'default flags')")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    systems = [system for system in args.systems.split(",") if system]
    if set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems: {', '.join(sorted(set(systems) - set(SYSTEMS)))}")
    notes = []
    if any(system in LLAMA_ARGS for system in systems) and not args.llama_server.is_file():
        notes.append(f"llama.cpp skipped: no llama-server at {args.llama_server} (build it, or pass --llama-server "
                     f"or set $LLAMA_SERVER)")
        systems = [system for system in systems if system not in LLAMA_ARGS]
    if "OMP_NUM_THREADS" in os.environ:
        notes.append(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} is set: pagedserve's workers follow it")
    gguf = ensure_smollm2()
    requests = make_workload(gguf)
    streams_list = [int(value) for value in args.streams.split(",")]
    workloads = {streams: (requests[:streams], True) if streams > 1 else (requests[:args.num_single_requests], False)
                 for streams in streams_list}
    stamp = timestamp()
    log_dir = RESULTS_DIR / f"real_model-{stamp}-logs"
    prompt_lens = [request.prompt_len for request in requests]
    report = {"machine": machine("torch", "transformers"), "threads": args.threads, "model": str(gguf),
              "workload": {"num_requests": len(requests), "prompt_lens": [min(prompt_lens), max(prompt_lens)],
                           "output_lens": list(OUTPUT_LENS), "num_single_requests": args.num_single_requests},
              "streams": streams_list, "dtypes": {}, "notes": notes, "load_average_start": os.getloadavg()}
    print(f"{report['machine']['cpu']}, {report['machine']['num_cores']} cores, torch {torch.__version__}; "
          f"SmolLM2-135M-Instruct; {len(requests)} prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens, "
          f"outputs {OUTPUT_LENS[0]}-{OUTPUT_LENS[1]}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)
    started = time.perf_counter()
    dense_dtypes = [dtype for dtype in args.dtypes.split(",") if dtype != QUANTIZED]
    probe = BandwidthProbe()
    report["limits"] = limits = measure_limits(dense_dtypes or ["bfloat16"], probe=probe)
    print(f"limits ({args.threads} threads): read {limits['read_gb_per_s']:.1f} GB/s; GEMM at 32 rows "
          + ", ".join(f"{dtype} {peaks['32']:.0f} GFLOP/s" for dtype, peaks in limits["gemm_gflops"].items()), flush=True)
    for dtype in args.dtypes.split(","):
        roofline = None if dtype == QUANTIZED else measure_matmul(SMOLLM2, getattr(torch, dtype))
        weight_bytes = (gguf.stat().st_size if dtype == QUANTIZED
                        else SMOLLM2.num_params * torch.empty(0, dtype=getattr(torch, dtype)).element_size())
        entry = {"roofline": roofline, "systems": {}, "mfu_decode": {}, "weight_bytes_per_token": weight_bytes,
                 "token_limits": token_limits(limits, weight_bytes, 2.0 * SMOLLM2.num_params, dtype)}
        report["dtypes"][dtype] = entry
        for system in systems:
            if system == "hf" and dtype == QUANTIZED:
                continue
            if system in PAGEDSERVE:
                run = run_pagedserve(dtype, workloads, log_dir, args.serve_args, whole=PAGEDSERVE[system],
                                     probe=probe)
                for streams in streams_list:
                    if roofline is not None and "decode_phase" in run.get(streams, {}):
                        entry["mfu_decode"][streams] = (run[streams]["decode_phase"]["gflops_per_second"]
                                                        / entry["roofline"]["peak_gflops"])
            elif system == "hf":
                run = run_hf(gguf, dtype, workloads)
            else:
                run = run_llama_cpp(args.llama_server, gguf, dtype, args.threads, workloads, log_dir,
                                    LLAMA_ARGS[system], probe)
            entry["systems"][system] = run
            for change in run.get("thread_changes", []):
                notes.append(f"{dtype} {system}: the worker went to {change['num_threads']} thread(s) at "
                             f"{change['timestamp']} (other processes used {change['other_cores']} cores)")
            print(f"  {dtype} {system}: " + ", ".join(
                f"{streams} stream(s) {run[streams]['tokens_per_second']:.1f} tok/s"
                + (f" (read {run[streams]['read_gb_per_s']:.1f} GB/s between its requests)"
                   if "read_gb_per_s" in run[streams] else "") for streams in streams_list), flush=True)
    report["wall_seconds"] = time.perf_counter() - started
    report["load_average_end"] = os.getloadavg()
    print()
    rows = summary_rows(report)
    print_table(rows, list(dict.fromkeys(key for row in rows for key in row)), title=f"output tokens/s (pagedserve with {' '.join(args.serve_args) or 'its default flags'}); limits: 1 stream = "
                "read bandwidth / weight bytes per token, 32 streams = GEMM peak at 32 rows / FLOPs per token")
    for dtype, entry in report["dtypes"].items():
        if entry["roofline"] is not None:
            print(f"{dtype}: matmul roofline {entry['roofline']['peak_gflops']:.1f} GFLOP/s ({args.threads} threads)")
        else:
            print(f"{dtype}:")
        for system, run in entry["systems"].items():
            print(f"  {system}: {run['config']}")
    for note in notes:
        print(f"note: {note}")
    report["date"], report["serve_args"] = stamp, args.serve_args
    paths = save_report(f"real_model-{stamp}", report)
    kept = {key: value for key, value in report.items() if key != "dtypes"}  # the figures, not every trace
    kept["dtypes"] = {dtype: {"token_limits": entry["token_limits"], "weight_bytes_per_token": entry["weight_bytes_per_token"],
                              "configs": {system: run["config"] for system, run in entry["systems"].items()},
                              "systems": {system: {str(streams): {key: run[streams][key]
                                                                  for key in ("tokens_per_second", "read_gb_per_s",
                                                                              "steady_tokens_per_second")
                                                                  if key in run[streams]}
                                                   for streams in streams_list}
                                          for system, run in entry["systems"].items()}}
                      for dtype, entry in report["dtypes"].items()}
    paths += save_kept("real_model", kept)
    print(f"load average {report['load_average_start'][0]:.2f} at the start, {report['load_average_end'][0]:.2f} "
          f"at the end; wrote {paths[0]} ({report['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
