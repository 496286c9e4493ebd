"""Swap versus recompute of a preempted group, timed on a real model through the worker's code.

A group of L tokens holds B = ceil(L / block_size) blocks. For each L the model first prefills
the L tokens into scattered device blocks (that prefill is the recompute: the KV of L tokens
computed again from the token ids, no sampling), then swaps the B blocks out to scattered host
blocks and back in. Everything goes through ModelRunner.execute, a StepPlan with only
blocks_to_swap_out or blocks_to_swap_in (no sequences) for the swaps:

    recompute   execute(StepPlan(seqs=[L tokens from position 0]))       -> seconds / L tokens
    swap        execute(StepPlan(blocks_to_swap_out=B pairs))
              + execute(StepPlan(blocks_to_swap_in=B pairs))             -> seconds / B blocks

Each run prefills once and then swaps SWAP_CYCLES times (fresh host blocks each time). Lengths
are interleaved round by round; a length keeps getting runs until it has `repeats` of them and
MIN_SECONDS of recompute time (short groups, whose single runs last milliseconds, get more, at
most MAX_RUNS), and the median of each series is kept. Interruptions by other processes on a
shared host only ever add time, so the more samples a cheap operation gets the better its median.
On a CPU-only host the "device" pool is host memory too, so a swap is a memory copy.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.contracts.step_plan import ScheduledSeq, StepPlan

BLOCK_SIZE = 16
SWAP_CYCLES = 5
MIN_SECONDS = 1.0
MAX_RUNS = 40


@dataclass(frozen=True, slots=True)
class SwapBenchModel:
    """A Llama-shaped checkpoint built by pagedserve.checkpoints.tiny_checkpoint (the demo model is built by
    pagedserve.checkpoints.demo with its own shape)."""

    label: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 1024
    max_position_embeddings: int = 4096

    @property
    def folder_name(self) -> str:
        return (f"memory-llama-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}-kv{self.num_kv_heads}"
                f"-i{self.intermediate_size}-v{self.vocab_size}")


BENCH_MODEL = SwapBenchModel(label="llama h512 l8", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                             intermediate_size=1408)


@dataclass(slots=True)
class PreparedModel:
    label: str
    path: Path
    build_seconds: float  # 0.0 when the checkpoint was already on disk


def prepare_demo_model() -> PreparedModel:
    from pagedserve.checkpoints.demo import demo_path, ensure_demo_model

    was_built = (demo_path() / "config.json").is_file()
    started = time.perf_counter()
    path = ensure_demo_model()
    return PreparedModel("demo", path, 0.0 if was_built else time.perf_counter() - started)


def prepare_bench_model(models_dir: Path, shape: SwapBenchModel = BENCH_MODEL) -> PreparedModel:
    from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint

    folder = models_dir / shape.folder_name
    if (folder / "config.json").is_file():
        return PreparedModel(shape.label, folder, 0.0)
    started = time.perf_counter()
    build_tiny_checkpoint(folder, hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                          num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                          intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
                          max_position_embeddings=shape.max_position_embeddings, seed=0)
    return PreparedModel(shape.label, folder, time.perf_counter() - started)


@dataclass(slots=True)
class LengthTiming:
    num_tokens: int
    num_blocks: int
    recompute_seconds: float  # medians over the repeats
    swap_out_seconds: float
    swap_in_seconds: float
    recompute_runs: list[float] = field(default_factory=list)
    swap_runs: list[tuple[float, float]] = field(default_factory=list)  # (out, in)

    @property
    def swap_seconds(self) -> float:
        return self.swap_out_seconds + self.swap_in_seconds

    @property
    def swap_seconds_per_block(self) -> float:
        return self.swap_seconds / self.num_blocks

    @property
    def recompute_seconds_per_token(self) -> float:
        return self.recompute_seconds / self.num_tokens

    def as_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "num_blocks": self.num_blocks,
                "recompute_seconds": self.recompute_seconds, "swap_out_seconds": self.swap_out_seconds,
                "swap_in_seconds": self.swap_in_seconds, "swap_seconds_per_block": self.swap_seconds_per_block,
                "recompute_seconds_per_token": self.recompute_seconds_per_token,
                "recompute_runs": self.recompute_runs, "swap_runs": [list(run) for run in self.swap_runs]}


@dataclass(slots=True)
class ModelTiming:
    label: str
    num_params: int
    bytes_per_block: int
    build_seconds: float
    load_seconds: float
    num_threads: int
    lengths: list[LengthTiming] = field(default_factory=list)

    @property
    def swap_seconds_per_block(self) -> float:
        """Median over the lengths."""
        return statistics.median(timing.swap_seconds_per_block for timing in self.lengths)

    @property
    def recompute_seconds_per_token(self) -> float:
        """Median over the lengths."""
        return statistics.median(timing.recompute_seconds_per_token for timing in self.lengths)

    @property
    def break_even_tokens_per_block(self) -> float:
        """Swapping is cheaper for a group whose blocks hold more tokens than this on average."""
        return self.swap_seconds_per_block / self.recompute_seconds_per_token

    def as_dict(self) -> dict:
        return {"label": self.label, "num_params": self.num_params, "bytes_per_block": self.bytes_per_block,
                "build_seconds": self.build_seconds, "load_seconds": self.load_seconds,
                "num_threads": self.num_threads, "lengths": [timing.as_dict() for timing in self.lengths],
                "swap_seconds_per_block": self.swap_seconds_per_block,
                "recompute_seconds_per_token": self.recompute_seconds_per_token,
                "break_even_tokens_per_block": self.break_even_tokens_per_block}


def _timed(run, plan: StepPlan) -> float:
    started = time.perf_counter()
    run(plan)
    return time.perf_counter() - started


def measure_swap_and_recompute(model: PreparedModel, lengths: list[int], *, repeats: int,
                               seed: int = 0) -> ModelTiming:
    import torch

    from pagedserve.worker.model_runner import ModelRunner

    started = time.perf_counter()
    runner = ModelRunner(model.path, device="cpu", dtype="auto", block_size=BLOCK_SIZE)
    runner.load()
    max_blocks = -(-max(lengths) // BLOCK_SIZE)
    num_pool_blocks = 4 * max_blocks
    runner.init_cache(num_pool_blocks, num_pool_blocks)
    load_seconds = time.perf_counter() - started
    vocab_size = runner.config.vocab_size
    rng = random.Random(seed)
    step_ids = iter(range(1, 1 << 30))

    recompute_runs: dict[int, list[float]] = {length: [] for length in lengths}
    swap_runs: dict[int, list[tuple[float, float]]] = {length: [] for length in lengths}

    def run_once(num_tokens: int) -> None:
        num_blocks = -(-num_tokens // BLOCK_SIZE)
        gpu_blocks = rng.sample(range(num_pool_blocks), num_blocks)
        token_ids = [rng.randrange(4, vocab_size) for _ in range(num_tokens)]
        prefill = StepPlan(step_id=next(step_ids), seqs=[
            ScheduledSeq(seq_id=0, token_ids=token_ids, start_position=0, block_table=gpu_blocks)])
        recompute_runs[num_tokens].append(_timed(runner.execute, prefill))
        for _ in range(SWAP_CYCLES):
            cpu_blocks = rng.sample(range(num_pool_blocks), num_blocks)
            swap_out = _timed(runner.execute, StepPlan(step_id=next(step_ids),
                                                       blocks_to_swap_out=list(zip(gpu_blocks, cpu_blocks))))
            swap_in = _timed(runner.execute, StepPlan(step_id=next(step_ids),
                                                      blocks_to_swap_in=list(zip(cpu_blocks, gpu_blocks))))
            swap_runs[num_tokens].append((swap_out, swap_in))

    def needs_runs(length: int) -> bool:
        runs = recompute_runs[length]
        return len(runs) < repeats or (sum(runs) < MIN_SECONDS and len(runs) < MAX_RUNS)

    for num_tokens in (min(lengths), max(lengths)):  # warm-up: allocator, kernels, caches
        run_once(num_tokens)
    for series in (*recompute_runs.values(), *swap_runs.values()):
        series.clear()
    while pending := [length for length in lengths if needs_runs(length)]:
        for length in pending:
            run_once(length)
    timing = ModelTiming(label=model.label, num_params=sum(param.numel() for param in runner.model.parameters()),
                         bytes_per_block=runner.cache_shape.bytes_per_block, build_seconds=model.build_seconds,
                         load_seconds=load_seconds, num_threads=torch.get_num_threads())
    for length in lengths:
        swap_out, swap_in = (statistics.median(column) for column in zip(*swap_runs[length]))
        timing.lengths.append(LengthTiming(num_tokens=length, num_blocks=-(-length // BLOCK_SIZE),
                                           recompute_seconds=statistics.median(recompute_runs[length]),
                                           swap_out_seconds=swap_out, swap_in_seconds=swap_in,
                                           recompute_runs=recompute_runs[length], swap_runs=swap_runs[length]))
    return timing
