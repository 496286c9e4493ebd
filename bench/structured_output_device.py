"""Structured output on a CUDA device: the worker's bitmask and logit_bias application and the
sampler on GPU logits give the CPU's answers, and what applying the rows costs.

    python bench/structured_output_device.py [cuda|cpu]   (torch only: imports no protobuf)

Rows of SmolLM2's width (49,152): 16 logits rows of which 8 constrained (each allowing 1..300
random tokens) and 2 biased. Checks: banned entries are -inf and allowed ones unchanged; greedy
picks equal the CPU's; random draws stay inside their masks; reported logprobs of the allowed
tokens sum to 1. Then the median time of apply_constraints over 200 runs, synchronised.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import pagedserve  # noqa: E402

pagedserve.__path__.append(str(REPO))  # pagedserve.worker -> worker/ without an install

from pagedserve.contracts.step_plan import SampleSpec  # noqa: E402
from pagedserve.worker.sampler import Sampler  # noqa: E402
from pagedserve.worker.structured_output import apply_constraints  # noqa: E402

VOCAB = 49152


def _row(allowed: np.ndarray) -> bytes:
    bits = np.zeros(((VOCAB + 31) // 32) * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def main() -> int:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    masked_rows = list(range(0, 16, 2))
    allowed = {row: rng.choice(VOCAB, size=int(rng.integers(1, 300)), replace=False) for row in masked_rows}
    bitmasks = b"".join(_row(allowed[row]) for row in masked_rows)
    specs = [SampleSpec(num_logprobs=5) for _ in range(16)]
    specs[1] = SampleSpec(logit_bias={7: 100.0}, num_logprobs=5)
    specs[3] = SampleSpec(logit_bias={int(i): -100.0 for i in range(0, VOCAB, 2)})
    logits_cpu = torch.randn(16, VOCAB, dtype=torch.bfloat16)
    out_cpu = apply_constraints(logits_cpu, masked_rows, bitmasks, specs)
    out_gpu = apply_constraints(logits_cpu.to(device), masked_rows, bitmasks, specs)
    assert torch.equal(out_gpu.cpu(), out_cpu), "GPU and CPU constrained logits differ"
    for row in masked_rows:
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[torch.from_numpy(allowed[row])] = True
        assert torch.isinf(out_cpu[row][~keep]).all() and torch.equal(out_cpu[row][keep], logits_cpu[row][keep].float())
    greedy_cpu = Sampler("cpu", seed=0).sample(out_cpu, specs, list(range(16)), [5] * 16)
    greedy_gpu = Sampler(device, seed=0).sample(out_gpu, specs, list(range(16)), [5] * 16)
    assert [s.token_id for s in greedy_cpu] == [s.token_id for s in greedy_gpu]
    assert greedy_gpu[1].token_id == 7 and greedy_gpu[3].token_id % 2 == 1
    random_specs = [SampleSpec(temperature=1.0, num_logprobs=3) for _ in range(16)]
    sampler = Sampler(device, seed=1)
    for _ in range(20):
        for row, sample in enumerate(sampler.sample(out_gpu, random_specs, list(range(16)), [5] * 16)):
            if row in allowed:
                assert sample.token_id in set(allowed[row].tolist())
    for row in masked_rows:
        total = torch.logsumexp(out_gpu[row].log_softmax(-1)[torch.from_numpy(allowed[row]).to(device)], -1)
        assert math.isclose(float(total), 0.0, abs_tol=1e-4)
    logits_gpu = logits_cpu.to(device)
    times = []
    for _ in range(200):
        sync()
        started = time.perf_counter()
        apply_constraints(logits_gpu, masked_rows, bitmasks, specs)
        sync()
        times.append((time.perf_counter() - started) * 1e6)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}; checks passed; apply_constraints on 16 x {VOCAB} bf16 rows "
          f"(8 masked, 2 biased): median {statistics.median(times):.0f} us over 200 runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
