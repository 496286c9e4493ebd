"""Where one decode step of the real model goes: the serving loop in-process, and the forward by
op class under torch.profiler.

    python bench/step_profile.py [--seqs 1,32] [--dtypes float32,bfloat16] [--threads 2] [--steps 20]

For each dtype and batch: SmolLM2-135M-Instruct (`--model smollm2`, the GGUF dequantized at load)
in a ModelRunner, N sequences decoding after 64-token prompts, run the way the processes run a
step (bench/lib/decode_steps.py serving_step_row: schedule -> plan codec -> execute (inputs, forward,
sampling) -> result codec -> process_result), medians over --steps steps. Then 10 x --steps later
steps of a decode run, derived and executed as the worker computes them without their plans
(run_step_row: worker/continuation.py's next_plan, then execute through the kept decode run): per
step the time outside the forward, the Python and the greedy kernel that run with the caches just
flushed by the weights. Then --steps more forwards under torch.profiler, the ops' self CPU time
grouped into classes:

    matmul        aten::mm / addmm / bmm, mkldnn::_linear_pointwise (the projections and the LM head)
    attention     scaled_dot_product_attention's kernels
    kv gather     index_select / index_copy_ / where / index: reading K/V out of the paged cache
                  and writing the new K/V into it
    norm/rope/act the elementwise ops of RMSNorm, rotary and SiLU-mul (mul, add, pow, mean, rsqrt,
                  silu, neg, cat, ...), casts and copies
    other ops     everything else torch dispatched
    outside ops   forward wall time not inside any torch op: Python and dispatch between the ops, and
                  the native kernels (pagedserve.kernels.native.library: RMSNorm, RoPE with the K/V
                  write, SiLU-mul, the few-rows linears, whole decoder layers at one or two
                  sequences), which the profiler does not see

Gives the absolute ms per step and the share of each. The `serve` part (ZeroMQ, gRPC, frontend) is
in bench/real_model.py's step records and bench/overheads.py. A table goes to stdout, JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import time

import torch

from lib.output import print_table, save_report, timestamp
from lib.decode_steps import decode_scheduler, run_step_row, serving_step_row

CLASSES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
               "aten::_weight_int4pack_mm_for_cpu"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                  "aten::_softmax", "aten::baddbmm"),
    "kv gather": ("aten::index_select", "aten::index_copy_", "aten::where", "aten::index", "aten::index_put_",
                  "aten::masked_fill_", "aten::_index_put_impl_"),
}
NORM_OPS = ("aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt", "aten::silu", "aten::neg",
            "aten::cat", "aten::copy_", "aten::_to_copy", "aten::sub", "aten::embedding", "aten::div",
            "aten::clone", "aten::contiguous", "aten::mul_", "aten::add_", "aten::silu_")


def op_class(name: str) -> str:
    for cls, names in CLASSES.items():
        if name in names:
            return cls
    return "norm/rope/act" if name in NORM_OPS else "other ops"


def forward_profile(model_path, dtype: str, num_seqs: int, num_steps: int) -> dict:
    """Self CPU ms per step of each op class in the model forward (the LM head included)."""
    from pagedserve.worker.model_input import build_model_input
    from pagedserve.worker.model_runner import ModelRunner

    runner = ModelRunner(model_path, device="cpu", dtype=dtype, block_size=16)
    runner.load()
    scheduler = decode_scheduler(num_seqs)
    runner.init_cache(scheduler.config.num_gpu_blocks, 0)
    model = runner.model
    plan = scheduler.schedule().plan
    inputs = build_model_input(plan.seqs, block_size=runner.block_size, num_blocks=runner.cache.num_gpu_blocks,
                               max_positions=model.max_positions, device=runner.device)

    def forward() -> None:
        model.compute_logits(model(inputs.token_ids, inputs.metadata, runner.cache.gpu_cache))

    with torch.inference_mode():
        for _ in range(3):
            forward()
        started = time.perf_counter()
        for _ in range(num_steps):
            forward()
        wall_ms = (time.perf_counter() - started) / num_steps * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            for _ in range(num_steps):
                forward()
    classes: dict[str, float] = {}
    top = []
    for event in profiler.key_averages():
        self_ms = event.self_cpu_time_total / 1e3 / num_steps
        classes[op_class(event.key)] = classes.get(op_class(event.key), 0.0) + self_ms
        top.append((self_ms, event.key, event.count // num_steps))
    profiled_ms = sum(classes.values())
    # the profiler's own cost per op inflates op time; scale the op classes to the unprofiled wall
    scale = min(1.0, wall_ms / max(profiled_ms, 1e-9))
    row = {"dtype": dtype, "num_seqs": num_seqs, "forward_ms": wall_ms}
    for cls in (*CLASSES, "norm/rope/act", "other ops"):
        row[cls] = classes.get(cls, 0.0) * scale
    row["outside ops"] = max(0.0, wall_ms - profiled_ms * scale)
    row["ops_per_step"] = sum(count for _, _, count in top)
    row["top_ops"] = [{"op": key, "self_ms": ms, "calls": count} for ms, key, count in sorted(top, reverse=True)[:12]]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.checkpoints.smollm2 import ensure_smollm2

    model_path = ensure_smollm2()
    loop_rows, run_rows, forward_rows = [], [], []
    for dtype in args.dtypes.split(","):
        for num_seqs in (int(value) for value in args.seqs.split(",")):
            loop_rows.append({"dtype": dtype, **serving_step_row(num_seqs, args.steps, model_path, dtype=dtype)})
            run_rows.append({"dtype": dtype, **run_step_row(num_seqs, 10 * args.steps, model_path, dtype=dtype)})
            forward_rows.append(forward_profile(model_path, dtype, num_seqs, args.steps))
            print(f"  {dtype} {num_seqs} seqs done", flush=True)
    print_table(loop_rows, ["dtype", "num_seqs", "step_ms", "forward_ms", "schedule_ms", "plan_codec_ms",
                            "build_inputs_ms", "sample_ms", "execute_other_ms", "result_codec_ms",
                            "process_result_ms", "outside_forward_ms"],
                title=f"one decode step in-process, ms (medians; {args.threads} threads)", float_format=",.2f")
    print_table(run_rows, ["dtype", "num_seqs", "run_step_outside_us", "run_step_forward_ms", "in_decode_run"],
                title=f"a decode run's later steps in-process: per step outside the forward, us (medians of "
                      f"{10 * args.steps})", float_format=",.1f")
    print_table([{key: value for key, value in row.items() if key != "top_ops"} for row in forward_rows],
                title="the forward by op class, ms per step (self CPU time, scaled to the unprofiled wall)",
                float_format=",.2f")
    for row in forward_rows:
        print(f"{row['dtype']} {row['num_seqs']} seqs, top ops: "
              + ", ".join(f"{op['op'].removeprefix('aten::')} {op['self_ms']:.2f} ms x{op['calls']}"
                          for op in row["top_ops"][:8]))
    paths = save_report(f"step_profile-{timestamp()}", {"threads": args.threads, "loop": loop_rows,
                                                         "decode_run": run_rows, "forward": forward_rows})
    print(f"wrote {paths[0]}")


if __name__ == "__main__":
    main()
