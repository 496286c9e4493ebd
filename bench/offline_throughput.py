"""Offline throughput: pagedserve against Hugging Face transformers on one workload, in one run.

    python bench/offline_throughput.py [--dtypes float32,bfloat16] [--systems pagedserve,hf-static,hf-cb]
                                       [--num-requests 64] [--threads 1] [--static-batch-size 16]

Workload (bench/lib/workload.py): 64 requests, prompt lengths uniform in 32-512 and output lengths
uniform in 16-256 (seed 0), random prompt ids, greedy, EOS ignored; the 55M-parameter
Llama-shaped model with seeded weights, loaded in the dtype of the run. For each dtype:

    roofline     best F.linear throughput on the model's weight shapes (bench/roofline.py)
    pagedserve   `pagedserve serve` in a process tree; all requests sent at once over
                 GenerateStream (gRPC), each token stamped as it arrives
    hf-static    model.generate on batches of --static-batch-size in request order, left-padded
                 to the batch's longest prompt, each batch run to its longest output length;
                 only the tokens each request asked for count
    hf-cb        transformers continuous batching (init_continuous_batching, one add_request per
                 request with its own max_new_tokens, EOS disabled)

Every system uses --threads torch threads (OMP_NUM_THREADS for the serve process tree), after a
short warm-up. Output tokens/s is requested output tokens over the wall time from the first
submission to the last token. Model FLOP utilization is pagedserve's achieved model FLOP/s
over the decode-heavy part (from the moment every prompt has its first token to the end, and the
part of it while at least half the requests still run) divided by the roofline peak; the
scheduler's step records give the share of those steps spent in the model forward. "workload s
at peak" is the workload's model FLOPs over the peak: no system can finish faster.
A table goes to stdout, JSON and a PNG to bench/results/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from lib.machine_info import machine
from lib.output import print_table, save_figure, save_report, timestamp
from roofline import measure_matmul
from pagedserve.launch.serve_process import ServeProcess
from lib.step_recorder import StepRecorder
from lib.stream_client import RequestTrace, run_requests
from lib.workload import BENCH_MODEL, RESULTS_DIR, BenchRequest, ModelShape, build_model, make_requests

SYSTEMS = ("pagedserve", "hf-static", "hf-cb")
LABELS = {"pagedserve": "pagedserve serve (gRPC)", "hf-static": "HF generate, static batches",
          "hf-cb": "HF generate_batch (continuous)"}
PAD_TOKEN_ID = 3
WARMUP = [BenchRequest(list(range(4, 68)), 8)]


# ---- pagedserve ------------------------------------------------------------------------------

def run_pagedserve(model_path: Path, dtype: str, requests: list[BenchRequest], threads: int,
                   log_dir: Path, serve_args: list[str]) -> dict:
    args = ["--dtype", dtype, "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
            "--num-kv-blocks", "4096", "--swap-space", "0.25", *serve_args]
    with ServeProcess(model_path, log_dir / f"serve-{dtype}.log", args, num_threads=threads) as server:
        run_requests(server.address, WARMUP)
        with tqdm(total=len(requests), desc=f"pagedserve {dtype}", unit="req", leave=False) as bar, \
                StepRecorder(server) as recorder:
            traces = run_requests(server.address, requests, on_done=lambda: bar.update(1))
    start = min(trace.sent_at for trace in traces)
    end = max(trace.finished_at for trace in traces)
    return {"seconds": end - start, "num_output_tokens": sum(trace.num_tokens for trace in traces),
            "steps": step_summary(list(recorder.records.values()), len(requests)), "traces": traces}


def step_summary(records: list, num_requests: int) -> dict:
    """Steps of the run as the scheduler timed them: all, and the decode-only steps with at least
    half the requests in the batch, with the share of their time spent in rank 0's forward."""
    def part(selected: list) -> dict:
        seconds = sum(record.seconds for record in selected)
        forward = sum(record.forward_seconds for record in selected)
        return {"num_steps": len(selected), "seconds": seconds, "forward_seconds": forward,
                "forward_share": forward / seconds if seconds else 0.0,
                "mean_batch": sum(r.num_decode_tokens + r.num_prefill_tokens for r in selected) / max(1, len(selected))}
    work = [record for record in records if record.num_decode_tokens + record.num_prefill_tokens > 0]
    decode = [record for record in work
              if record.num_prefill_tokens == 0 and 2 * record.num_decode_tokens >= num_requests]
    return {"all": part(work), "decode_half_running": part(decode)}


def workload_gflops(requests: list[BenchRequest], shape: ModelShape) -> float:
    """Model GFLOPs the workload needs at the least: every prompt token once (logits only for the
    last), every output token after the first once."""
    flops = 0.0
    for request in requests:
        flops += sum(shape.flops_per_token(position + 1, is_logits_row=position == request.prompt_len - 1)
                     for position in range(request.prompt_len))
        flops += sum(shape.flops_per_token(request.prompt_len + index) for index in range(1, request.max_tokens))
    return flops / 1e9


def decode_phase(traces: list[RequestTrace], shape: ModelShape, *, min_running_fraction: float = 0.0) -> dict:
    """Model FLOPs and seconds from the moment every request has its first token to the end (or
    to when fewer than min_running_fraction of the requests are still running)."""
    begin = max(trace.token_times[0] for trace in traces)
    finish_times = sorted(trace.finished_at for trace in traces)
    num_allowed_done = len(traces) - max(1, int(min_running_fraction * len(traces)))
    end = finish_times[num_allowed_done] if min_running_fraction else finish_times[-1]
    flops, num_tokens = 0.0, 0
    for trace in traces:
        for index, stamp in enumerate(trace.token_times):
            if begin < stamp <= end:
                flops += shape.flops_per_token(trace.prompt_len + index)
                num_tokens += 1
    seconds = end - begin
    return {"seconds": seconds, "num_tokens": num_tokens, "model_gflops": flops / 1e9,
            "gflops_per_second": flops / seconds / 1e9 if seconds > 0 else 0.0}


def gflops_timeline(traces: list[RequestTrace], shape: ModelShape, bin_seconds: float = 1.0) -> list[dict]:
    """Achieved model GFLOP/s of decode tokens in bins of bin_seconds from the first submission."""
    start = min(trace.sent_at for trace in traces)
    bins: dict[int, float] = {}
    for trace in traces:
        for index, stamp in enumerate(trace.token_times[1:], start=1):
            key = int((stamp - start) // bin_seconds)
            bins[key] = bins.get(key, 0.0) + shape.flops_per_token(trace.prompt_len + index)
    return [{"t": key * bin_seconds, "gflops_per_second": flops / bin_seconds / 1e9}
            for key, flops in sorted(bins.items())]


# ---- Hugging Face baselines ------------------------------------------------------------------

def load_hf(model_path: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as in the pagedserve requests
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def _static_batch(model, batch: list[BenchRequest]) -> None:
    from transformers import GenerationConfig

    width = max(request.prompt_len for request in batch)
    max_new_tokens = max(request.max_tokens for request in batch)
    input_ids = torch.full((len(batch), width), PAD_TOKEN_ID, dtype=torch.long)  # [B, width], left-padded
    attention_mask = torch.zeros_like(input_ids)
    for row, request in enumerate(batch):
        input_ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - request.prompt_len:] = 1
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD_TOKEN_ID)
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
    if output.shape[1] != width + max_new_tokens:
        raise RuntimeError(f"HF generate stopped early: {output.shape[1] - width} of {max_new_tokens} tokens")


def run_hf_static(model_path: Path, dtype: str, requests: list[BenchRequest], batch_size: int) -> dict:
    model = load_hf(model_path, dtype)
    _static_batch(model, WARMUP)
    start = time.perf_counter()
    with tqdm(total=len(requests), desc=f"hf-static {dtype}", unit="req", leave=False) as bar:
        for begin in range(0, len(requests), batch_size):
            batch = requests[begin:begin + batch_size]
            _static_batch(model, batch)
            bar.update(len(batch))
    seconds = time.perf_counter() - start
    num_computed = sum(len(requests[b:b + batch_size]) * max(r.max_tokens for r in requests[b:b + batch_size])
                       for b in range(0, len(requests), batch_size))
    return {"seconds": seconds, "num_output_tokens": sum(request.max_tokens for request in requests),
            "num_computed_tokens": num_computed}


def run_hf_cb(model_path: Path, dtype: str, requests: list[BenchRequest], max_batch_tokens: int,
              max_requests_per_batch: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(model_path, dtype)
    config = GenerationConfig(max_new_tokens=max(request.max_tokens for request in requests), do_sample=False,
                              eos_token_id=-1, pad_token_id=PAD_TOKEN_ID)
    num_blocks = len(requests) * 4 + 8  # pages of 256 tokens: room for every request at once
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                                            max_requests_per_batch=max_requests_per_batch))
    manager.start()
    try:
        _cb_generate(manager, WARMUP)
        start = time.perf_counter()
        with tqdm(total=len(requests), desc=f"hf-cb {dtype}", unit="req", leave=False) as bar:
            num_tokens = _cb_generate(manager, requests, on_done=lambda: bar.update(1))
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return {"seconds": seconds, "num_output_tokens": num_tokens}


def _cb_generate(manager, requests: list[BenchRequest], on_done=lambda: None) -> int:
    ids = [manager.add_request(request.prompt_token_ids, max_new_tokens=request.max_tokens, eos_token_id=-1)
           for request in requests]
    finished: dict[str, int] = {}
    while len(finished) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            finished[result.request_id] = len(result.generated_tokens)
            on_done()
        elif result is None and not manager.is_running():
            raise RuntimeError("the continuous batching loop stopped")
    for request, request_id in zip(requests, ids):
        if finished[request_id] != request.max_tokens:
            raise RuntimeError(f"{request_id}: {finished[request_id]} tokens, {request.max_tokens} asked for")
    return sum(finished.values())


# ---- report ----------------------------------------------------------------------------------

def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (bars, timeline) = plt.subplots(1, 2, figsize=(12, 4.2))
    dtypes = list(report["dtypes"])
    width = 0.8 / len(SYSTEMS)
    for offset, system in enumerate(SYSTEMS):
        values = [report["dtypes"][dtype]["systems"].get(system, {}).get("tokens_per_second", 0) for dtype in dtypes]
        positions = [index + (offset - (len(SYSTEMS) - 1) / 2) * width for index in range(len(dtypes))]
        drawn = bars.bar(positions, values, width, label=LABELS[system])
        bars.bar_label(drawn, fmt="%.0f", fontsize=8)
    bars.set_xticks(range(len(dtypes)), dtypes)
    bars.set_ylabel("output tokens / s")
    bars.set_title(f"Offline throughput, {report['workload']['num_requests']} requests")
    bars.legend(fontsize=8)
    for dtype in dtypes:
        entry = report["dtypes"][dtype]
        timeline_points = entry.get("gflops_timeline")
        if not timeline_points:
            continue
        line, = timeline.plot([p["t"] for p in timeline_points], [p["gflops_per_second"] for p in timeline_points],
                              label=f"pagedserve {dtype}")
        timeline.axhline(entry["roofline"]["peak_gflops"], color=line.get_color(), linestyle="--",
                         label=f"matmul peak {dtype}")
    timeline.set_xlabel("seconds since submission")
    timeline.set_ylabel("model GFLOP/s (decode tokens)")
    timeline.set_title("pagedserve achieved FLOP/s vs measured matmul peak")
    timeline.legend(fontsize=8)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every system")
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--cb-max-batch-tokens", type=int, default=512,
                        help="max_batch_tokens of transformers continuous batching")
    parser.add_argument("--cb-max-requests", type=int, default=16,
                        help="max_requests_per_batch of transformers continuous batching (on CPU its attention "
                             "runs over the whole batch with a mask, so cost grows with the batch squared)")
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for pagedserve serve (last on the command line)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    systems = [system for system in args.systems.split(",") if system]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    stamp = timestamp()
    log_dir = RESULTS_DIR / f"offline-{stamp}-logs"
    shape = BENCH_MODEL
    model_path = build_model(shape)
    requests = make_requests(args.num_requests, (32, 512), (16, 256), vocab_size=shape.vocab_size, seed=0)
    report = {"machine": machine("torch", "transformers"), "threads": args.threads, "model": {"name": shape.name,
              "num_params": shape.num_params, "path": str(model_path)},
              "workload": {"num_requests": len(requests), "prompt_lens": [32, 512], "output_lens": [16, 256],
                           "num_prompt_tokens": sum(r.prompt_len for r in requests),
                           "num_output_tokens": sum(r.max_tokens for r in requests), "seed": 0},
              "static_batch_size": args.static_batch_size, "cb_max_batch_tokens": args.cb_max_batch_tokens,
              "cb_max_requests_per_batch": args.cb_max_requests,
              "dtypes": {}}
    print(f"{report['machine']['cpu']}, {report['machine']['num_cores']} cores, torch {torch.__version__}, "
          f"{args.threads} thread(s); model {shape.name} ({shape.num_params / 1e6:.1f}M parameters); "
          f"{len(requests)} requests, {report['workload']['num_prompt_tokens']} prompt and "
          f"{report['workload']['num_output_tokens']} output tokens\n")
    report["workload"]["model_gflops"] = workload_gflops(requests, shape)
    started = time.perf_counter()
    for dtype in args.dtypes.split(","):
        entry = {"roofline": measure_matmul(shape, getattr(torch, dtype)), "systems": {}}
        entry["roofline"]["workload_seconds_at_peak"] = (report["workload"]["model_gflops"]
                                                         / entry["roofline"]["peak_gflops"])
        report["dtypes"][dtype] = entry
        for system in systems:
            if system == "pagedserve":
                run = run_pagedserve(model_path, dtype, requests, args.threads, log_dir, args.serve_args)
                traces = run.pop("traces")
                entry["decode_phase"] = decode_phase(traces, shape)
                entry["decode_phase_half_running"] = decode_phase(traces, shape, min_running_fraction=0.5)
                entry["gflops_timeline"] = gflops_timeline(traces, shape)
                peak = entry["roofline"]["peak_gflops"]
                entry["mfu_decode"] = entry["decode_phase"]["gflops_per_second"] / peak
                entry["mfu_decode_half_running"] = entry["decode_phase_half_running"]["gflops_per_second"] / peak
            elif system == "hf-static":
                run = run_hf_static(model_path, dtype, requests, args.static_batch_size)
            else:
                run = run_hf_cb(model_path, dtype, requests, args.cb_max_batch_tokens, args.cb_max_requests)
            run["tokens_per_second"] = run["num_output_tokens"] / run["seconds"]
            entry["systems"][system] = run
            print(f"  {dtype} {system}: {run['tokens_per_second']:.1f} output tokens/s "
                  f"({run['seconds']:.1f} s)", flush=True)
    report["wall_seconds"] = time.perf_counter() - started

    rows = []
    for dtype, entry in report["dtypes"].items():
        ours = entry["systems"].get("pagedserve", {}).get("tokens_per_second")
        for system, run in entry["systems"].items():
            ratio = f"{ours / run['tokens_per_second']:.2f}x" if ours and system != "pagedserve" else ""
            rows.append({"dtype": dtype, "system": LABELS[system], "tps": run["tokens_per_second"],
                         "seconds": run["seconds"], "ratio": ratio})
    print()
    print_table(rows, ["dtype", "system", ("output tok/s", "tps"), ("wall s", "seconds"),
                       ("pagedserve speed-up", "ratio")])
    roofline_rows = []
    for dtype, entry in report["dtypes"].items():
        if "decode_phase" in entry:
            steps = entry["systems"]["pagedserve"]["steps"]["decode_half_running"]
            roofline_rows.append({
                "dtype": dtype, "peak": entry["roofline"]["peak_gflops"],
                "decode": entry["decode_phase"]["gflops_per_second"], "mfu": f"{100 * entry['mfu_decode']:.0f}%",
                "half": entry["decode_phase_half_running"]["gflops_per_second"],
                "mfu_half": f"{100 * entry['mfu_decode_half_running']:.0f}%",
                "forward_share": f"{100 * steps['forward_share']:.0f}%",
                "forward_mfu": f"{100 * entry['mfu_decode_half_running'] / max(steps['forward_share'], 1e-9):.0f}%",
                "bound": entry["roofline"]["workload_seconds_at_peak"]})
    if roofline_rows:
        print_table(roofline_rows, ["dtype", ("matmul GFLOP/s", "peak"),
                                    ("decode-phase GFLOP/s", "decode"), ("MFU", "mfu"),
                                    (">=50% running GFLOP/s", "half"), ("MFU", "mfu_half"),
                                    ("forward share of those steps", "forward_share"),
                                    ("MFU in the forward (est.)", "forward_mfu"),
                                    ("workload s at peak", "bound")])
    paths = save_report(f"offline-{stamp}", report, plot)
    print(f"wrote {' and '.join(map(str, paths))} ({report['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
