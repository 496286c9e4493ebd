"""Logits at every position of a token sequence, computed through the paged path.

For accuracy measurements (quantization, KV-cache dtypes): the sequence is prefilled in chunks
of `chunk_size` tokens, each chunk writing its K/V into the cache and attending over the cached
prefix exactly as a chunked prefill in serving does, but with every row of the chunk sent to the
LM head instead of only the last one.

    tokens   t0 t1 t2 ... t{n-1}
    logits   row i scores the token after t_i  (so rows 0..n-2 predict t1..t{n-1})

The sequence occupies blocks 0 .. ceil(n / block_size) - 1 of the runner's device pool; the
caller must not hold anything there.
"""

from __future__ import annotations

import torch

from pagedserve.contracts.step_plan import ScheduledSeq
from pagedserve.worker.model_input import build_model_input
from pagedserve.worker.model_runner import ModelRunner, RunnerStateError

DEFAULT_CHUNK_SIZE = 256


def sequence_logits(runner: ModelRunner, token_ids: list[int], *,
                    chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """token_ids [n] -> float32 logits [n, vocab] on the CPU (rank 0; world size 1)."""
    if runner.model is None or runner.cache is None:
        raise RunnerStateError("load() and init_cache() must run first")
    if runner.world_size != 1:
        raise RunnerStateError("sequence_logits runs on a single rank")
    block_size = runner.block_size
    num_blocks = -(-len(token_ids) // block_size)
    if num_blocks > runner.cache.num_gpu_blocks:
        raise ValueError(f"{len(token_ids)} tokens need {num_blocks} blocks, the pool has "
                         f"{runner.cache.num_gpu_blocks}")
    block_table = list(range(num_blocks))
    model = runner.model
    rows = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), chunk_size):
            chunk = token_ids[start:start + chunk_size]
            seq = ScheduledSeq(seq_id=0, token_ids=chunk, start_position=start,
                               block_table=block_table[: -(-(start + len(chunk)) // block_size)])
            inputs = build_model_input([seq], block_size=block_size, num_blocks=runner.cache.num_gpu_blocks,
                                       max_positions=model.max_positions, device=runner.device)
            inputs.metadata.logits_indices = torch.arange(len(chunk), device=runner.device)
            hidden = model(inputs.token_ids, inputs.metadata, runner.cache.gpu_cache)  # [chunk, hidden]
            rows.append(model.compute_logits(hidden).float().cpu())  # [chunk, vocab]
    return torch.cat(rows)
