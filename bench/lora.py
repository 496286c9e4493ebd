"""Multi-LoRA serving cost: 32 streams over 1, 4 and 16 adapters against the base model alone.

    python bench/lora.py [--streams 32] [--prompt-len 64] [--max-tokens 64] [--rank 8]
                         [--dtype float32|bfloat16] [--threads 1] [--rounds 2] [--device cpu|cuda]

In-process, one ModelRunner of the benchmark model (bench/lib/workload.py) with --enable-lora's
slots (max_loras 16): greedy prefill of every stream in one step, then one decode step per token
for all of them. Configurations, interleaved step by step so they share the machine's load:

    base        every stream on the base model (the runner has adapter slots, no row uses one)
    1 adapter   every stream on the same adapter
    4, 16       the streams spread evenly over 4 or 16 adapters (a mixed batch: one gather per slot)

Adapters are PEFT folders (rank --rank on all seven projections, non-zero B) built once into
bench/results/models/; loads happen before timing. Reported: decode tokens/s (32 streams x
(max_tokens - 1) tokens / decode time), decode step time, its ratio to the base, and the cost of
each extra adapter in a step ((step_16 - step_1) / 15). A table goes to stdout and JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from lib.machine_info import machine
from lib.output import RESULTS_DIR, print_table, save_report, timestamp
from lib.workload import BENCH_MODEL, build_model
from pagedserve.adapters.lora_config import LoraConfig
from pagedserve.adapters.peft_folder import folder_digest
from pagedserve.contracts.step_plan import LoraLoad, SampleSpec, ScheduledSeq, StepPlan
from pagedserve.testing.lora_adapters import build_peft_adapters
from pagedserve.worker.model_runner import ModelRunner

NUM_ADAPTERS = (0, 1, 4, 16)


def adapters_for(model, rank: int) -> list:
    folder = RESULTS_DIR / "models" / f"{model.name}-lora-r{rank}"
    outs = [(folder / f"adapter{i}", 1000 + i) for i in range(max(NUM_ADAPTERS))]
    if not all((out / "adapter_model.safetensors").exists() for out, _ in outs):
        build_peft_adapters(model, outs, rank=rank)
    return [out for out, _ in outs]


def run(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> dict[int, dict]:
    """Greedy prefill + decode of every prompt once per configuration. The configurations own
    separate sequences and blocks and take their steps in turn (prefill, then decode step by decode
    step), so each step of each one sees the same machine load. Stream i of configuration k runs on
    slot i % k (the base model for k = 0)."""
    num_streams = len(prompts)
    per_seq = -(-(len(prompts[0]) + max_tokens) // runner.block_size)
    spec = SampleSpec()
    state = {}
    for index, k in enumerate(NUM_ADAPTERS):
        first_block = index * num_streams * per_seq
        state[k] = {"tokens": [list(prompt) for prompt in prompts],
                    "tables": [list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
                               for i in range(num_streams)],
                    "slots": [i % k if k else -1 for i in range(num_streams)],
                    "prefill_seconds": 0.0, "decode_seconds": 0.0, "num_decode_steps": 0}
    step_id = 0

    def step(k: int, prefill: bool) -> float:
        nonlocal step_id
        step_id += 1
        run_state = state[k]
        tokens, tables, slots = run_state["tokens"], run_state["tables"], run_state["slots"]
        seqs = [ScheduledSeq(i, tokens[i] if prefill else tokens[i][-1:], 0 if prefill else len(tokens[i]) - 1,
                             tables[i], spec, lora_slot=slots[i]) for i in range(num_streams)]
        started = time.perf_counter()
        result = runner.execute(StepPlan(step_id=step_id, seqs=seqs))
        seconds = time.perf_counter() - started
        by_seq = {sample.seq_id: sample.token_id for sample in result.samples}
        for i in range(num_streams):
            tokens[i].append(by_seq[i])
        return seconds

    for k in NUM_ADAPTERS:
        state[k]["prefill_seconds"] += step(k, prefill=True)
    for _ in range(max_tokens - 1):
        for k in NUM_ADAPTERS:
            state[k]["decode_seconds"] += step(k, prefill=False)
            state[k]["num_decode_steps"] += 1
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (two on two shared cores stall each other at every small matmul)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(BENCH_MODEL, "float32")
    folders = adapters_for(model, args.rank)
    runner = ModelRunner(model, device=args.device, dtype=args.dtype, block_size=16,
                         lora=LoraConfig(max_loras=max(NUM_ADAPTERS), max_lora_rank=args.rank))
    runner.load()
    per_seq = -(-(args.prompt_len + args.max_tokens) // 16)
    runner.init_cache(len(NUM_ADAPTERS) * args.streams * per_seq, 0)
    runner.execute(StepPlan(step_id=0, lora_loads=[LoraLoad(i, f"adapter{i}", str(folder), folder_digest(folder))
                                                   for i, folder in enumerate(folders)]))
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, BENCH_MODEL.vocab_size, (args.streams, args.prompt_len), generator=generator).tolist()
    load = os.getloadavg()
    totals = {k: {"prefill_seconds": 0.0, "decode_seconds": 0.0, "num_decode_steps": 0} for k in NUM_ADAPTERS}
    run(runner, prompts, 3)  # warm-up
    for _ in range(args.rounds):
        result = run(runner, prompts, args.max_tokens)
        for k in NUM_ADAPTERS:
            for key in ("prefill_seconds", "decode_seconds", "num_decode_steps"):
                totals[k][key] += result[k][key]
    load_after = os.getloadavg()
    base_step = totals[0]["decode_seconds"] / totals[0]["num_decode_steps"]
    rows = []
    for k in NUM_ADAPTERS:
        step = totals[k]["decode_seconds"] / totals[k]["num_decode_steps"]
        rows.append({"adapters": k or "base", "decode_tok_s": args.streams / step, "step_ms": step * 1e3,
                     "vs_base": step / base_step,
                     "prefill_ms": totals[k]["prefill_seconds"] / args.rounds * 1e3})
    step_of = {k: totals[k]["decode_seconds"] / totals[k]["num_decode_steps"] for k in NUM_ADAPTERS}
    per_extra_ms = (step_of[16] - step_of[1]) / 15 * 1e3
    title = (f"{args.streams} streams, {args.prompt_len}-token prompts, {args.max_tokens} tokens, rank {args.rank}, "
             f"{args.dtype}, {args.device}, {args.threads} threads; load {load[0]:.1f} -> {load_after[0]:.1f}")
    print_table(rows, ["adapters", ("decode tok/s", "decode_tok_s"), ("step ms", "step_ms"),
                       ("x base", "vs_base"), ("prefill ms", "prefill_ms")], title=title, float_format=",.2f")
    print(f"cost of one adapter over the base: {(step_of[1] / step_of[0] - 1) * 100:.1f} % of a decode step; "
          f"each extra adapter in the batch: {per_extra_ms:.2f} ms per step")
    report = {"machine": machine("torch"), "args": vars(args), "model": BENCH_MODEL.name,
              "loadavg_before": load, "loadavg_after": load_after, "rows": rows,
              "extra_adapter_ms_per_step": per_extra_ms}
    print("wrote", *save_report(f"lora-{timestamp()}", report))


if __name__ == "__main__":
    main()
