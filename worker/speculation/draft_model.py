"""The draft model of draft-model speculation (--speculative-model): a second, smaller (or more
coarsely quantized) Llama-family checkpoint with the target's vocabulary, loaded on every rank
with the target's loader, dtype and tensor-parallel sharding and its own quantization
(--speculative-quantization).

Its KV cache lives beside the target's (cache_engine.py): per draft layer a K and a V tensor with
the target's number of blocks and block size, addressed by the same block ids and slots, so the
scheduler's block tables cover both. The draft writes its KV for a position into the slot the
target uses for that position.

A draft that cannot serve with the target is a configuration error (DraftModelError, a
ValueError: the worker exits 2 with one line): a vocabulary of another size, or heads that cannot
be split over the tensor-parallel ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.kernels.ops import resolve_kv_cache_dtype
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.cache_engine import CacheShape, KVCache
from pagedserve.worker.loading.build import LoadedModel, load_model
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.llama_config import LlamaModelConfig
from pagedserve.worker.quantization.quantizers import QuantizationConfig
from pagedserve.worker.layers.tensor_parallel import TensorParallelError, TensorParallelGroup


class DraftModelError(ValueError):
    """The draft model does not fit the target model or the tensor-parallel layout."""


class DraftModel:
    """One rank's shard of the draft model; `load` checks it against the target, then reads it."""

    def __init__(self, path: str | Path, *, quantization: str = "none",
                 quantization_group_size: int | None = None) -> None:
        self.path = Path(path)
        self.quantization = QuantizationConfig(quantization, quantization_group_size)
        self.config: LlamaModelConfig | None = None
        self.loaded: LoadedModel | None = None
        self.kv_cache_dtype: torch.dtype | None = None

    def load(self, *, target_config: LlamaModelConfig, tp: TensorParallelGroup, dtype: torch.dtype,
             device: torch.device, max_positions: int, kv_cache_dtype: str) -> None:
        """Raises DraftModelError before reading any weight when the draft cannot serve with the target."""
        config = LlamaModelConfig.from_folder(self.path)
        if config.vocab_size != target_config.vocab_size:
            raise DraftModelError(
                f"--speculative-model {self.path}: its vocabulary has {config.vocab_size} tokens, the target "
                f"model's {target_config.vocab_size}; a draft model must share the target's vocabulary")
        try:
            tp.even_shard(config.num_heads, "num_attention_heads")
            tp.kv_head_shard(config.num_kv_heads, config.num_heads)
        except TensorParallelError as exc:
            raise DraftModelError(f"--speculative-model {self.path}: its {config.num_heads} attention heads and "
                                  f"{config.num_kv_heads} KV heads cannot be split over {tp.world_size} "
                                  f"tensor-parallel ranks: {exc}") from None
        self.config = config
        self.loaded = load_model(self.path, config, tp=tp, dtype=dtype, device=device, max_positions=max_positions,
                                 quantization=self.quantization)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)

    @property
    def model(self) -> LlamaForCausalLM:
        if self.loaded is None:
            raise RuntimeError("the draft model is not loaded")
        return self.loaded.model

    @property
    def num_weight_bytes(self) -> int:
        return self.loaded.num_weight_bytes if self.loaded is not None else 0

    def cache_shape(self, block_size: int) -> CacheShape:
        """This rank's draft KV geometry for the pool's block size."""
        model = self.model
        return CacheShape(num_layers=len(model.layers), block_size=block_size,
                          num_kv_heads=model.num_kv_heads_per_rank, head_size=model.head_size,
                          dtype=self.kv_cache_dtype)

    def logits(self, token_ids: torch.Tensor, metadata: AttentionMetadata,
               kv_caches: list[KVCache]) -> torch.Tensor | None:
        """token_ids [T] -> logits [num_sampled, vocab] of metadata's logits rows on rank 0 (None
        elsewhere, and when no row samples), writing the draft KV of every token into its slot."""
        model = self.model
        hidden = model(token_ids, metadata, kv_caches)  # [num_sampled, hidden]
        return model.compute_logits(hidden) if metadata.logits_indices.numel() else None
