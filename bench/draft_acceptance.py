"""Draft-model speculation in one worker, without a scheduler: how many of a draft model's
proposals the target accepts, and whether the greedy tokens are those of plain decoding.

    python bench/draft_acceptance.py [--model smollm2] [--speculative-model PATH (default: --model)]
                                     [--speculative-quantization int4] [--dtype float32]
                                     [--quantization none] [--k 4] [--max-tokens 64] [--threads 1]
                                     [--workload grounded|chat] [--prompts N]

Each prompt (bench/lib/spec_workload.py's workloads, with the model's chat template) is decoded greedily
twice by one ModelRunner holding target and draft: plainly, and with K drafts per step from the
draft model (runner_driver.generate_drafting, the scheduler's bookkeeping of draft KV). Acceptance
rate = accepted / proposed; mean accepted length = tokens emitted per verifying step (accepted + 1).
The seconds are in-process step times on whatever the host is doing; bench/spec_speedup.py measures
speed through the server. A table goes to stdout and JSON to bench/results/.
"""

from __future__ import annotations

import argparse

import torch
from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from lib.runner_driver import blocks_needed, generate, generate_drafting
from lib.spec_workload import CHAT, GROUNDED

from pagedserve.frontend.tokenization.tokenizer import load_tokenizer
from pagedserve.checkpoints.resolve import resolve_model
from pagedserve.worker.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--speculative-model", default=None)
    parser.add_argument("--speculative-quantization", default="int4", choices=("none", "int8", "int4", "auto"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workload", default="grounded", choices=("grounded", "chat"))
    parser.add_argument("--prompts", type=int, default=None, help="the first N prompts of the workload")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    draft_path = resolve_model(args.speculative_model or args.model)
    tokenizer = load_tokenizer(path)
    texts = (GROUNDED if args.workload == "grounded" else CHAT)[:args.prompts]
    runner = ModelRunner(path, device="cpu", dtype=args.dtype, block_size=16, quantization=args.quantization,
                         speculative_model=draft_path, speculative_quantization=args.speculative_quantization)
    runner.load()
    rows = []
    for number, text in enumerate(texts):
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        runner.init_cache(blocks_needed([prompt], args.max_tokens + args.k, runner.block_size), 0)
        plain = generate(runner, [prompt], args.max_tokens)
        drafted = generate_drafting(runner, [prompt], args.max_tokens, args.k)
        row = {"prompt": number, "prompt_tokens": len(prompt), "proposed": drafted.num_drafted,
               "accepted": drafted.num_accepted,
               "acceptance_rate": drafted.num_accepted / drafted.num_drafted,
               "mean_accepted_length": (drafted.num_accepted + drafted.num_verify_steps) / drafted.num_verify_steps,
               "plain_seconds": plain.prefill_seconds + plain.decode_seconds, "drafting_seconds": drafted.seconds,
               "is_same_output": drafted.token_ids == plain.token_ids}
        rows.append(row)
        print(row, flush=True)
    proposed, accepted = sum(r["proposed"] for r in rows), sum(r["accepted"] for r in rows)
    steps = sum(r["proposed"] for r in rows) // args.k
    rows.append({"prompt": "all", "proposed": proposed, "accepted": accepted, "acceptance_rate": accepted / proposed,
                 "mean_accepted_length": (accepted + steps) / steps,
                 "plain_seconds": sum(r["plain_seconds"] for r in rows),
                 "drafting_seconds": sum(r["drafting_seconds"] for r in rows),
                 "is_same_output": all(r["is_same_output"] for r in rows)})
    print_table(rows, ["prompt", "prompt_tokens", "proposed", "accepted", "acceptance_rate", "mean_accepted_length",
                       "plain_seconds", "drafting_seconds", "is_same_output"],
                title=f"draft-model speculation in one worker: {args.model} drafted by "
                      f"{args.speculative_model or args.model} ({args.speculative_quantization}), K={args.k}",
                float_format=",.2f")
    save_report(f"draft-acceptance-{timestamp()}", {"machine": machine("torch"), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
