"""Whether a GGUF file served with its blocks kept (--quantization auto) answers as the same file
dequantized (--quantization none): greedy continuations of bench/quant_accuracy.py's chat prompts.

    python bench/gguf_greedy.py [--gguf FILE] [--prompts 8] [--new-tokens 32] [--dtype float32]

Both runners go through our ModelRunner and the paged path in --dtype; the table says per prompt
whether the continuations are identical and where they first differ. In a dtype other than
float32 both are also compared with the file dequantized in float32 (the exact values): in
bfloat16 `none` multiplies the weights rounded to bfloat16 while `auto`'s decode steps multiply the
exact weights, so the two differ from each other, and the columns say which stays nearer the
exact model. The default file is the SmolLM2-135M-Instruct Q4_1 copy `--model smollm2` serves.
JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from perf_tables import save_kept
from pagedserve.worker.model_runner import ModelRunner
from lib.runner_driver import blocks_needed, generate

DATA = Path(__file__).resolve().parent / "data"
BATCH = 8


def default_gguf() -> Path:
    from pagedserve.checkpoints.resolve import resolve_model

    return Path(resolve_model("smollm2"))


def chat_prompts(gguf: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = json.loads((DATA / "quant_prompts.json").read_text())[:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for text in texts]


def greedy(gguf: Path, quantization: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> tuple[list, float]:
    runner = ModelRunner(gguf, device="cpu", dtype=dtype, block_size=16, quantization=quantization)
    runner.load()
    runner.init_cache(blocks_needed(prompts[:BATCH], new_tokens, 16), 0)
    started, out = time.perf_counter(), []
    for start in range(0, len(prompts), BATCH):
        out += generate(runner, prompts[start:start + BATCH], new_tokens).token_ids
    return out, time.perf_counter() - started


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    gguf = args.gguf or default_gguf()
    if gguf.is_dir():
        gguf = next(gguf.glob("*.gguf"))
    prompts = chat_prompts(gguf, args.prompts)
    dense, dense_seconds = greedy(gguf, "none", args.dtype, prompts, args.new_tokens)
    kept, kept_seconds = greedy(gguf, "auto", args.dtype, prompts, args.new_tokens)
    rows = [{"prompt": i, "prompt tokens": len(prompt), "identical": a == b, "first difference": first_difference(a, b)}
            for i, (prompt, a, b) in enumerate(zip(prompts, dense, kept))]
    if args.dtype != "float32":
        exact, _ = greedy(gguf, "none", "float32", prompts, args.new_tokens)
        for row, a, b, reference in zip(rows, dense, kept, exact):
            row["none vs float32: first difference"] = first_difference(a, reference)
            row["auto vs float32: first difference"] = first_difference(b, reference)
    print_table(rows, title=f"{gguf.name}, {args.dtype}: greedy --quantization auto against none "
                            f"({args.new_tokens} tokens per prompt)")
    same = sum(row["identical"] for row in rows)
    print(f"identical: {same} of {len(rows)}; decode wall time none {dense_seconds:.1f} s, auto {kept_seconds:.1f} s")
    if args.dtype != "float32":
        for name in ("none", "auto"):
            column = [row[f"{name} vs float32: first difference"] for row in rows]
            print(f"{name} in {args.dtype} equal to the float32 dequantized file: {column.count(None)} of {len(rows)}")
    report = {"machine": machine("torch"), "gguf": str(gguf), "dtype": args.dtype, "new_tokens": args.new_tokens,
              "num_identical": same, "rows": rows, "seconds": {"none": dense_seconds, "auto": kept_seconds}}
    report["date"] = timestamp()
    for path in save_report(f"gguf_greedy-{report['date']}", report) + save_kept("gguf_greedy", report):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
