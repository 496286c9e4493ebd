"""Time to first token of a long shared prefix: cold, warm from the device pool, warm from the host
tier (after other load evicted it), warm from the disk tier (after a restart of serve), and cold on a serve without the tiers (what
the saves and the disk write-through cost a cold prompt).

    python bench/kv_tiers.py [--prefix-tokens 2000] [--hidden-size 256] [--num-layers 4] [--repeats 3]

One float32 toy checkpoint (tiny_checkpoint, Llama-shaped), one `serve` with a small device pool
(--num-kv-blocks), --kv-offloading-size and --kv-cache-dir; each of `repeats` distinct prefixes is
asked cold, again at once (device hit), again after a filler prompt of the same length (host hit),
and after serve restarted on the same folder (disk hit: fetched into host slots, then loaded).
TTFT is measured by the client: from sending GenerateStream to its first message. The table gives
medians, each tier's ratio to cold and the cached tokens reported in usage; the greedy tokens of
every warm answer are checked against the cold one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
from pagedserve.checkpoints.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tokenizer
from pagedserve.launch.serve_process import ServeProcess
from pagedserve.v1 import generation_pb2

VOCAB_SIZE = 512


def _request(prompt: list[int]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.PromptTokenIds(ids=prompt),
                                          params=generation_pb2.SamplingParams(max_tokens=4, ignore_eos=True))


def ask(server: ServeProcess, prompt: list[int]) -> tuple[float, list[int], int]:
    """(TTFT seconds, greedy tokens, cached prompt tokens)."""
    started = time.perf_counter()
    ttft, tokens, cached = None, [], 0
    for message in server.stub.GenerateStream(_request(prompt), timeout=600):
        if ttft is None:
            ttft = time.perf_counter() - started
        for completion in message.completions:
            tokens.extend(completion.token_ids)
        if message.HasField("usage"):
            cached = message.usage.cached_prompt_tokens
    return ttft, tokens, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-kv-blocks", type=int, default=160)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kv-tiers-bench-"))
    model = work / "model"
    build_tokenizer(model, vocab_size=VOCAB_SIZE)
    build_tiny_checkpoint(model, architecture="llama", vocab_size=VOCAB_SIZE, hidden_size=args.hidden_size,
                          num_layers=args.num_layers, num_heads=4, num_kv_heads=2,
                          intermediate_size=4 * args.hidden_size, max_position_embeddings=4096,
                          bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, seed=1)
    flags = ["--dtype", "float32", "--num-kv-blocks", str(args.num_kv_blocks), "--kv-offloading-size", "0.5",
             "--kv-cache-dir", str(work / "kv"), "--max-num-batched-tokens", "2048"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(args.prefix_tokens)] for _ in range(args.repeats)]
    filler = [rng.randrange(3, VOCAB_SIZE) for _ in range(args.prefix_tokens)]
    results: dict[str, list[tuple[float, int]]] = {"cold": [], "device": [], "host": [], "disk": []}
    cold_tokens = []
    with ServeProcess(model, work / "serve.log", flags) as server:
        ask(server, [5, 6, 7])  # warm-up
        for prompt in prompts:
            ttft, tokens, cached = ask(server, prompt)
            results["cold"].append((ttft, cached))
            cold_tokens.append(tokens)
            ttft, tokens, cached = ask(server, prompt)
            assert tokens == cold_tokens[-1], "device hit changed the tokens"
            results["device"].append((ttft, cached))
        for prompt, expected in zip(prompts, cold_tokens):
            ask(server, filler)
            ttft, tokens, cached = ask(server, prompt)
            assert tokens == expected, "host hit changed the tokens"
            results["host"].append((ttft, cached))
    with ServeProcess(model, work / "serve-restarted.log", flags) as server:
        ask(server, [5, 6, 7])
        for prompt, expected in zip(prompts, cold_tokens):
            ttft, tokens, cached = ask(server, prompt)
            assert tokens == expected, "disk hit changed the tokens"
            results["disk"].append((ttft, cached))
    # the cost of the tiers on a cold prompt (saves and write-through snapshots in the steps):
    # the same prompts on a serve without them, the same order
    plain = [flag for flag in flags if flag not in ("--kv-offloading-size", "0.5", "--kv-cache-dir", str(work / "kv"))]
    with ServeProcess(model, work / "serve-plain.log", plain) as server:
        ask(server, [5, 6, 7])
        for prompt, expected in zip(prompts, cold_tokens):
            ttft, tokens, cached = ask(server, prompt)
            assert tokens == expected
            results.setdefault("cold, no tiers", []).append((ttft, cached))
    cold = statistics.median(ttft for ttft, _ in results["cold"])
    print(f"prefix {args.prefix_tokens} tokens, hidden {args.hidden_size}, {args.num_layers} layers, float32, "
          f"{args.repeats} prefixes; load {open('/proc/loadavg').read().split()[:3]}")
    print(f"{'source':14} {'TTFT ms (median)':>11} {'vs cold':>8} {'cached tokens':>14}")
    for name, runs in results.items():
        median = statistics.median(ttft for ttft, _ in runs)
        print(f"{name:14} {median * 1000:11.1f} {median / cold:8.2f} {min(cached for _, cached in runs):14d}")
    files = os.listdir(next((work / "kv").iterdir()))
    print(f"block files: {len(files)}, {sum(os.path.getsize(next((work / 'kv').iterdir()) / name) for name in files)} bytes")


if __name__ == "__main__":
    main()
