"""Attention over the paged KV cache for a flat batch mixing prefill chunks and decodes.

Tokens of all scheduled sequences are concatenated into one batch of num_tokens rows:

    rows       [ seq 0: prefill chunk (many) ][ seq 1: decode (1) ][ seq 2: decode (1) ] ...
    query_start_loc  0                         q0                   q0+1              ...

Per layer the new tokens' K/V are written into their cache slots first, then every query row
attends causally over its sequence's whole context read back through the block table (so cached
prefix tokens and new tokens are treated alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.kernels import ops


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about the batch; built once per step, shared by all layers.

    step_plans: what the kernels derive from the other fields (decode chunks, slots, masks; see
    pagedserve.kernels.ops), filled by the first layer and reused by the others. Whoever changes
    a field after a forward must clear it.
    """

    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot (block_id * block_size + offset)
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    logits_indices: torch.Tensor  # [num_sampled] int64, rows whose hidden state becomes logits
    step_plans: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class PagedAttention(torch.nn.Module):
    """Writes new K/V into the cache, then attends; no weights (projections live in the model).

    k_scale and v_scale: what an fp8 cache's stored values are multiplied by when read (1.0 unless
    set; see pagedserve.kernels.cache.kv_dtype); other caches ignore them.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, *, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, not {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # K and V, each [num_blocks, block_size, kvh, hs]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_size]
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping, self.k_scale, self.v_scale,
                           metadata.step_plans)
        return self.attend(query, kv_cache, metadata)

    def attend(self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               metadata: AttentionMetadata) -> torch.Tensor:  # [T, nh, hs] -> [T, nh * hs]
        """Attention alone, the step's K/V being in the cache already (written by the caller)."""
        key_cache, value_cache = kv_cache
        out = ops.paged_attention(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                                  metadata.query_start_loc, self.scale, self.sliding_window, self.k_scale,
                                  self.v_scale, metadata.step_plans)  # [T, nh, hs]
        return out.reshape(out.shape[0], self.num_heads * self.head_size)
