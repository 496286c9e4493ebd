"""Child process for test_triton_path_tokens: greedy tokens of a checkpoint through ModelRunner,
with attention and KV writes computed by whichever kernels PAGEDSERVE_KERNELS selects.

Usage: python triton_path_child.py CHECKPOINT [DEVICE]  -> prints a JSON list of generated token lists
(DEVICE: cpu, the default, or cuda).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_driver import DrivenSeq, PlanDriver  # noqa: E402

from pagedserve.worker.model_runner import ModelRunner  # noqa: E402

PROMPTS = [[11, 12, 13, 14, 15], [(7 * i) % 400 + 4 for i in range(20)],
           [(13 * i) % 400 + 4 for i in range(37)]]
MAX_NEW_TOKENS = 6
TOKEN_BUDGET = 24  # prefill chunks start and end mid-block, decodes share steps with them


def main(checkpoint: str, device: str = "cpu") -> None:
    runner = ModelRunner(checkpoint, device=device, dtype="float32", block_size=16)
    runner.load()
    runner.init_cache(64, 0)
    driver = PlanDriver(runner, num_blocks=64)
    seqs = [DrivenSeq(seq_id=i, prompt=p, max_new_tokens=MAX_NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    driver.run_to_completion(seqs, token_budget=TOKEN_BUDGET)
    print(json.dumps([seq.generated for seq in seqs]))


if __name__ == "__main__":
    main(*sys.argv[1:3])
