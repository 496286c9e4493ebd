"""Per-step overheads of the serving path, measured in-process (no sockets) and in `serve`.

    python bench/overheads.py [--seqs 1,4,16,64,256,1024] [--batch 256] [--steps 50] [--threads 1]

1. Scheduler: schedule() and process_result() per decode step with N running sequences
   (N = --seqs), pure Python against a stand-in worker that returns one greedy token per
   sequence; prompts of 64 tokens, greedy, EOS ignored, prefix caching on.
2. Plan codec: encode_plan + plan_from_proto of the --batch-sequence decode plan from (1), and
   encode_result + result_from_proto of its result; bytes on the wire.
3. One serving step at --batch decodes on a tiny Llama (hidden 64, 2 layers, vocabulary 512),
   the way the processes run it: schedule -> encode plan -> decode plan -> ModelRunner.execute
   (inputs, forward, sampling) -> encode result -> decode result -> process_result. Reported:
   the model forward (with the LM head) and everything else, split by part.
4. The same batch through `pagedserve serve` (real processes, ZeroMQ, gRPC streams to the
   client): step time and forward time from the scheduler's recent step records, and the CPU
   time each process (and this client) spent per streamed token.
A table goes to stdout, JSON and a PNG to bench/results/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from pagedserve.internal import step_pb2
from pagedserve.contracts.plan_codec import encode_plan, encode_result, plan_from_proto, result_from_proto
from lib.decode_steps import PROMPT_LEN, cpu_seconds, decode_scheduler, fake_result, median_ms, serving_step_row
from lib.output import print_table, save_figure, save_report, timestamp
from lib.workload import RESULTS_DIR, ModelShape, build_model

TINY_MODEL = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                        vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)


def scheduler_rows(seq_counts: list[int], num_steps: int) -> list[dict]:
    rows = []
    for num_seqs in tqdm(seq_counts, desc="scheduler", leave=False):
        scheduler = decode_scheduler(num_seqs)
        schedule_s, process_s = [], []
        for _ in range(num_steps):
            started = time.perf_counter()
            step = scheduler.schedule()
            scheduled = time.perf_counter()
            scheduler.process_result(step, fake_result(step.plan))
            schedule_s.append(scheduled - started)
            process_s.append(time.perf_counter() - scheduled)
            if len(step.plan.seqs) != num_seqs:
                raise RuntimeError(f"{len(step.plan.seqs)} sequences scheduled, {num_seqs} running")
        rows.append({"num_seqs": num_seqs, "schedule_ms": median_ms(schedule_s),
                     "process_result_ms": median_ms(process_s),
                     "step_ms": median_ms([a + b for a, b in zip(schedule_s, process_s)])})
    return rows


def codec_row(num_seqs: int, num_steps: int) -> dict:
    scheduler = decode_scheduler(num_seqs)
    step = scheduler.schedule()
    result = fake_result(step.plan)
    encode, decode, result_encode, result_decode = [], [], [], []
    for _ in range(num_steps):
        started = time.perf_counter()
        payload = encode_plan(step.plan)
        encoded = time.perf_counter()
        message = step_pb2.SchedulerMessage()
        message.ParseFromString(payload)
        plan_from_proto(message.step_plan)
        decoded = time.perf_counter()
        result_payload = encode_result(result)
        result_encoded = time.perf_counter()
        worker_message = step_pb2.WorkerMessage()
        worker_message.ParseFromString(result_payload)
        result_from_proto(worker_message.step_result)
        finished = time.perf_counter()
        encode.append(encoded - started)
        decode.append(decoded - encoded)
        result_encode.append(result_encoded - decoded)
        result_decode.append(finished - result_encoded)
    return {"num_seqs": num_seqs, "plan_bytes": len(payload), "plan_encode_ms": median_ms(encode),
            "plan_decode_ms": median_ms(decode), "result_bytes": len(result_payload),
            "result_encode_ms": median_ms(result_encode), "result_decode_ms": median_ms(result_decode)}


def serve_row(num_seqs: int, model_path: Path, threads: int, log_dir: Path) -> dict:
    """num_seqs long greedy requests at once through `serve`; step and forward seconds of the
    steps where all of them decode, from the scheduler's recent step records."""
    from pagedserve.launch.serve_process import ServeProcess
    from lib.step_recorder import StepRecorder
    from lib.stream_client import run_requests
    from lib.workload import BenchRequest

    requests = [BenchRequest([(index * 7 + offset) % 500 + 4 for offset in range(PROMPT_LEN)], 160)
                for index in range(num_seqs)]
    args = ["--dtype", "float32", "--max-num-seqs", str(num_seqs), "--max-num-batched-tokens",
            str(max(2048, num_seqs)), "--num-kv-blocks", str(num_seqs * 16 + 64), "--swap-space", "0.25"]
    with ServeProcess(model_path, log_dir / "serve-overheads.log", args, num_threads=threads) as server:
        roles = server.child_pids()
        cpu_before = {role: cpu_seconds(pid) for role, pid in roles.items()}
        client_before = time.process_time()
        with StepRecorder(server) as recorder:
            traces = run_requests(server.address, requests)
        cpu = {role: cpu_seconds(pid) - cpu_before[role] for role, pid in roles.items()}
        cpu["client"] = time.process_time() - client_before
    num_tokens = sum(trace.num_tokens for trace in traces)
    records = recorder.records
    full = [r for r in records.values() if r.num_decode_tokens == num_seqs and r.num_prefill_tokens == 0]
    if not full:
        return {"num_seqs": num_seqs, "num_steps": 0}
    step = [r.seconds for r in full]
    forward = [r.forward_seconds for r in full]
    return {"num_seqs": num_seqs, "num_steps": len(full), "step_ms": median_ms(step),
            "forward_ms": median_ms(forward),
            "outside_forward_ms": median_ms([s - f for s, f in zip(step, forward)]),
            **{f"{role}_cpu_us_per_token": seconds / num_tokens * 1e6 for role, seconds in sorted(cpu.items())}}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = report["scheduler"]
    seqs = [row["num_seqs"] for row in rows]
    for key, label in (("schedule_ms", "schedule()"), ("process_result_ms", "process_result()"),
                       ("step_ms", "both")):
        left.plot(seqs, [row[key] for row in rows], marker="o", label=label)
    left.axhline(1.0, color="grey", linestyle="--", label="1 ms")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("running sequences (all decoding)")
    left.set_ylabel("ms per step")
    left.set_title("Scheduler time per step")
    left.legend(fontsize=8)
    step = report["serving_step"]
    names = ["schedule", "plan_codec", "build_inputs", "sample", "execute_other", "result_codec", "process_result"]
    values = [step[f"{name}_ms"] for name in names]
    right.barh(names, values)
    for index, value in enumerate(values):
        right.text(value, index, f" {value:.2f}", va="center", fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("ms per step")
    right.set_title(f"In-process step at {step['num_seqs']} decodes, tiny model: {step['outside_forward_ms']:.2f} ms\n"
                    f"outside the forward ({step['forward_ms']:.2f} ms), by part", fontsize=10)
    save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1,4,16,64,256,1024")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-serve", action="store_true", help="skip the measurement through `serve`")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    stamp = timestamp()
    report = {"threads": args.threads}
    report["scheduler"] = scheduler_rows([int(n) for n in args.seqs.split(",")], args.steps)
    print_table(report["scheduler"], title="Scheduler, ms per decode step (median)", float_format=".3f")
    report["codec"] = codec_row(args.batch, args.steps)
    print_table([report["codec"]], title=f"Plan and result codec, {args.batch} decodes (ms, bytes)",
                float_format=".3f")
    model_path = build_model(TINY_MODEL)
    report["serving_step"] = serving_step_row(args.batch, args.steps, model_path)
    print_table([report["serving_step"]], float_format=".3f",
                title=f"One serving step in-process, {args.batch} decodes, tiny model (ms, median)")
    if not args.no_serve:
        report["serve"] = serve_row(args.batch, model_path, args.threads, RESULTS_DIR / f"overheads-{stamp}-logs")
        print_table([report["serve"]], title=f"Through `serve`, {args.batch} decodes (ms, median)",
                    float_format=".3f")
    paths = save_report(f"overheads-{stamp}", report, plot)
    print(f"wrote {' and '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
