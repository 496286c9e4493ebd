"""Weight memory and decode speed of one model under each weight format, and KV blocks per dtype.

    python bench/quant_speed.py --model /tmp/smollm2-hf [--gguf smollm2] [--steps 32] [--repeats 3] [--threads N]

In-process through ModelRunner (no scheduler, no gRPC: the worker's step cost alone). Each format
prefills 32 chat prompts, then times --steps greedy decode steps with 1 stream and with 32
streams; the best of --repeats runs is kept (the machine may be shared). tokens/s = streams x
steps / decode seconds. Rows:

    fp32            float32 weights and activations (the CPU default)
    bf16            --dtype bfloat16: bfloat16 weights and activations
    int8, int4 g128 quantized linear layers, float32 activations elsewhere (the quantized matmuls
                    run on bfloat16 activations: packed kernels up to 16 rows, dequantize-then-
                    matmul above); embeddings/LM head stay float32
    GGUF kept       --gguf FILE (or `smollm2`) with --quantization auto: its Q4_0/Q4_1 linear
                    weights packed as int4 groups of 32 as stored (Q8_0 as int8), the rest float32
    GGUF dequant    the same file with --quantization none: every weight dequantized to float32

Weight bytes are this rank's parameters (world size 1), all of them and the linear layers alone.
The KV table gives the bytes of one block (all layers, K and V) and the blocks a 4 GiB pool holds
for every KV dtype. A table goes to stdout and JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lib.machine_info import machine
from lib.output import print_table, save_report, timestamp
from pagedserve.kernels.cache.kv_dtype import KV_CACHE_DTYPES
from pagedserve.worker.cache_engine import GIB, CacheShape, blocks_for_bytes
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.quantization.linear import QuantizableLinear
from lib.runner_driver import blocks_needed, generate

DATA = Path(__file__).resolve().parent / "data"
FORMATS = {  # name -> ModelRunner options
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4 g128": {"dtype": "float32", "quantization": "int4", "quantization_group_size": 128},
    "int8 (bf16 dtype)": {"dtype": "bfloat16", "quantization": "int8"},
    "int4 g128 (bf16 dtype)": {"dtype": "bfloat16", "quantization": "int4", "quantization_group_size": 128},
    "GGUF kept": {"dtype": "float32", "quantization": "auto", "gguf": True},
    "GGUF dequant": {"dtype": "float32", "quantization": "none", "gguf": True},
}
STREAMS = (1, 32)
KV_BUDGET_GIB = 4


def linear_bytes(runner: ModelRunner) -> int:
    return sum(param.numel() * param.element_size() for module in runner.model.modules()
               if isinstance(module, QuantizableLinear) for param in module.parameters(recurse=False)
               if param is not module.bias)


def decode_rate(runner: ModelRunner, prompts: list[list[int]], steps: int, repeats: int) -> float:
    best = 0.0
    for _ in range(repeats):
        generation = generate(runner, prompts, steps + 1)
        best = max(best, len(prompts) * generation.num_decode_steps / generation.decode_seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gguf", default=None, help="a GGUF file (or `smollm2`) of the same model, for the GGUF rows")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset")
    args = parser.parse_args()
    if args.gguf is not None:
        from pagedserve.checkpoints.resolve import resolve_model

        args.gguf = resolve_model(args.gguf)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = json.loads((DATA / "quant_prompts.json").read_text())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for text in texts][:max(STREAMS)]
    rows = []
    shape = None
    for name in args.formats.split(","):
        options = dict(FORMATS[name])
        is_gguf = options.pop("gguf", False)
        if is_gguf and args.gguf is None:
            print(f"{name} skipped: no --gguf", flush=True)
            continue
        runner = ModelRunner(args.gguf if is_gguf else args.model, device="cpu", block_size=16, **options)
        runner.load()
        runner.init_cache(blocks_needed(prompts, args.steps + 1, runner.block_size), 0)
        shape = runner.cache_shape
        row = {"format": name, "weight MiB": runner.num_weight_bytes / 2**20,
               "linear MiB": linear_bytes(runner) / 2**20}
        with torch.inference_mode():
            for streams in STREAMS:
                row[f"tok/s {streams} stream{'s' if streams > 1 else ''}"] = decode_rate(
                    runner, prompts[:streams], args.steps, args.repeats)
        rows.append(row)
        print(f"{name} done", flush=True)
        del runner
    print_table(rows, title=f"{args.model}: decode in-process through ModelRunner, {torch.get_num_threads()} threads, "
                            f"best of {args.repeats} x {args.steps} steps")
    kv_rows = []
    for kv_name, dtype in KV_CACHE_DTYPES.items():
        kv_shape = CacheShape(shape.num_layers, shape.block_size, shape.num_kv_heads, shape.head_size, dtype)
        kv_rows.append({"kv dtype": kv_name, "KiB per block": kv_shape.bytes_per_block / 1024,
                        f"blocks in {KV_BUDGET_GIB} GiB": blocks_for_bytes(KV_BUDGET_GIB * GIB, kv_shape),
                        f"tokens in {KV_BUDGET_GIB} GiB": blocks_for_bytes(KV_BUDGET_GIB * GIB, kv_shape)
                        * kv_shape.block_size})
    print_table(kv_rows, title=f"KV cache ({shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
                               f"{shape.head_size}, block size {shape.block_size})")
    report = {"machine": machine("torch"), "model": str(args.model), "gguf": str(args.gguf),
              "threads": torch.get_num_threads(),
              "steps": args.steps, "repeats": args.repeats, "rows": rows, "kv": kv_rows}
    for path in save_report(f"quant_speed-{timestamp()}", report):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
