"""Interleaved A/B of the SmolLM2 decode forward: a git revision's model code against the working tree's,
in one process.

    python bench/forward_ab.py --base REV [--tree REV] [--seqs 1,32] [--dtypes bfloat16,float32] [--rounds 7]
                               [--iters 10]

The revision's `pagedserve` package (pagedserve/, worker/, kernels/, scheduler/, frontend/ from
`git archive REV`) is imported under the same module names, its objects kept, and the working
tree's modules put back, so both models live side by side; `--tree REV` takes the B side from a revision too (one
change at a time: --base C~1 --tree C). For each dtype and batch size both
load SmolLM2-135M-Instruct (`--model smollm2`), get N sequences decoding after 64-token prompts
(bench/lib/decode_steps.py decode_scheduler), and run the forward plus the LM head in alternating
rounds (A then B, then B then A, ...), `--iters` forwards per round. Medians per forward over all
rounds; the ratio is base / tree (above 1: the tree is faster). Each side first prefills the
prompts into its own KV cache; both use the same weights, so their logits are also compared (max
absolute difference and greedy agreement of the last forward).

Other jobs on the machine slow both sides alike within a round; the load average is printed. On a
host whose memory bandwidth moves between windows (docs/cpu-limits.md, "Why the bandwidth moves by
half"), `--probe` samples it (roofline.BandwidthProbe, 0.05 s) before each round and also gives the
ratio per round, medians over the rounds in the upper and the lower half of the samples: a change to
what runs while one thread streams shows in the wide windows only. Run it
with GOMP_SPINCOUNT=30000, as the worker runs by default (worker/cpu_share.py): both sides' native
libraries are tuned at their first load in this process, and passive waits change what they choose.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from lib.output import print_table
from pagedserve.contracts.step_plan import ScheduledSeq
from lib.decode_steps import decode_scheduler
from roofline import BandwidthProbe

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"pagedserve": "", "worker": "worker", "kernels": "kernels", "scheduler": "scheduler",
                "frontend": "frontend"}


def import_revision(rev: str, root: Path):
    """The revision's ModelRunner and build_model_input, imported from a copy of its tree."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *PACKAGE_DIRS], check=True,
                             capture_output=True).stdout
    src = root / "src"
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(src, filter="data")
    package = root / "pkg" / "pagedserve"
    shutil.copytree(src / "pagedserve", package)
    for folder in ("worker", "kernels", "scheduler", "frontend"):
        shutil.copytree(src / folder, package / folder)
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "pagedserve"}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(root / "pkg"))
    try:
        runner_module = importlib.import_module("pagedserve.worker.model_runner")
        input_module = importlib.import_module("pagedserve.worker.model_input")
        if not runner_module.__file__.startswith(str(root)):
            raise RuntimeError(f"imported {runner_module.__file__}, not the revision's copy")
        # its native library, built and tuned now: its loader imports the tuning module lazily,
        # which later would find the working tree's
        importlib.import_module("pagedserve.kernels.native.library").load()
        return runner_module.ModelRunner, input_module.build_model_input
    finally:
        sys.path.remove(str(root / "pkg"))
        for name in [name for name in sys.modules if name.split(".")[0] == "pagedserve"]:
            del sys.modules[name]
        sys.modules.update(saved)


def setup(runner_class, build_input, model_path, dtype: str, num_seqs: int):
    runner = runner_class(model_path, device="cpu", dtype=dtype, block_size=16)
    runner.load()
    scheduler = decode_scheduler(num_seqs)
    runner.init_cache(scheduler.config.num_gpu_blocks, 0)
    plan = scheduler.schedule().plan
    prompts = [ScheduledSeq(seq_id=seq.seq_id, start_position=0, block_table=seq.block_table,
                            token_ids=[(seq.seq_id * 7 + offset) % 500 + 4 for offset in range(seq.start_position)])
               for seq in plan.seqs]  # each side prefills its own cache, as serving would
    prefill = build_input(prompts, block_size=16, num_blocks=runner.cache.num_gpu_blocks,
                          max_positions=runner.model.max_positions, device=runner.device)
    with torch.inference_mode():
        runner.model(prefill.token_ids, prefill.metadata, runner.cache.gpu_cache)
    inputs = build_input(plan.seqs, block_size=16, num_blocks=runner.cache.num_gpu_blocks,
                         max_positions=runner.model.max_positions, device=runner.device)
    model, caches = runner.model, runner.cache.gpu_cache

    def forward() -> torch.Tensor:
        return model.compute_logits(model(inputs.token_ids, inputs.metadata, caches))

    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision of the A side")
    parser.add_argument("--tree", help="git revision of the B side (default: the working tree)")
    parser.add_argument("--seqs", default="1,32")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probe", action="store_true", help="sample the bandwidth before each round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.checkpoints.smollm2 import ensure_smollm2
    from pagedserve.worker.model_input import build_model_input
    from pagedserve.worker.model_runner import ModelRunner

    model_path = ensure_smollm2()
    rows, window_rows = [], []
    probe = BandwidthProbe() if args.probe else None
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base_runner, base_input = import_revision(args.base, Path(tmp) / "base")
        tree_runner, tree_input = ModelRunner, build_model_input
        if args.tree:
            tree_runner, tree_input = import_revision(args.tree, Path(tmp) / "tree")
        for dtype in args.dtypes.split(","):
            for num_seqs in (int(value) for value in args.seqs.split(",")):
                sides = {"base": setup(base_runner, base_input, model_path, dtype, num_seqs),
                         "tree": setup(tree_runner, tree_input, model_path, dtype, num_seqs)}
                times: dict[str, list[float]] = {"base": [], "tree": []}
                rounds: list[tuple[float, float]] = []  # (GB/s sampled, base / tree in the round)
                logits = {}
                with torch.inference_mode():
                    for name, forward in sides.items():  # warm-up
                        for _ in range(3):
                            logits[name] = forward()
                    for round_index in range(args.rounds):
                        order = ("base", "tree") if round_index % 2 == 0 else ("tree", "base")
                        sampled = probe.sample(0.05) if probe else 0.0
                        for name in order:
                            for _ in range(args.iters):
                                started = time.perf_counter()
                                logits[name] = sides[name]()
                                times[name].append(time.perf_counter() - started)
                        rounds.append((sampled, statistics.median(times["base"][-args.iters:]) /
                                       statistics.median(times["tree"][-args.iters:])))
                base_ms = statistics.median(times["base"]) * 1e3
                tree_ms = statistics.median(times["tree"]) * 1e3
                diff = (logits["base"].float() - logits["tree"].float()).abs().max().item()
                rows.append({"dtype": dtype, "num_seqs": num_seqs, "base_ms": base_ms, "tree_ms": tree_ms,
                             "speedup": base_ms / tree_ms, "max_logit_diff": diff,
                             "same_argmax": bool(torch.equal(logits["base"].argmax(-1), logits["tree"].argmax(-1)))})
                print(f"  {dtype} {num_seqs} seqs: {base_ms:.2f} -> {tree_ms:.2f} ms", flush=True)
                if probe:
                    rounds.sort()
                    for half, part in (("lower", rounds[:len(rounds) // 2]), ("upper", rounds[len(rounds) // 2:])):
                        window_rows.append({"dtype": dtype, "num_seqs": num_seqs, "half": half, "rounds": len(part),
                                            "GB/s": statistics.median(gbs for gbs, _ in part),
                                            "speedup": statistics.median(ratio for _, ratio in part),
                                            "faster_in": sum(ratio > 1 for _, ratio in part)})
                del sides
    print_table(rows, ["dtype", "num_seqs", "base_ms", "tree_ms", "speedup", "max_logit_diff", "same_argmax"],
                title=f"decode forward + LM head, ms (medians of {args.rounds} x {args.iters}; base {args.base}, "
                      f"tree {args.tree or 'working tree'}, {args.threads} threads)", float_format=",.3f")
    if window_rows:
        print_table(window_rows, ["dtype", "num_seqs", "half", "rounds", "GB/s", "speedup", "faster_in"],
                    title="per round, by the bandwidth sampled before it (medians over the rounds of each half)",
                    float_format=",.3f")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
