"""The Llama family (Llama 2/3, Mistral, Qwen2) over a paged KV cache, tensor-parallel ready.

One decoder layer on a flat token batch (T rows, see pagedserve.worker.layers.attention):

    x --+--> RMSNorm --> qkv_proj --> RoPE(q, k) --> write K/V --> paged attention --> o_proj --> (+) --> h
        +--------------------------------- residual ----------------------------------------------^
    h --+--> RMSNorm --> gate_up_proj --> silu(gate) * up --> down_proj ---------------------> (+) --> next x
        +--------------------------------- residual ----------------------------------------------^

The residual adds are folded into the next RMSNorm and done in place on one residual tensor (see
pagedserve.worker.layers.layernorm); RoPE rotates the query and key heads of the fused projection in one
go, and SiLU-mul reads the gate/up output once. On CPU float32/bfloat16 tensors each of these is one
native kernel call (pagedserve.kernels.ops), and RoPE also writes the new K/V into the cache, so
PagedAttention only attends (`attend`); elsewhere the torch paths run and PagedAttention writes.
Only the rows named by metadata.logits_indices (the last token of each sampling sequence) go
through the final norm and the LM head.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import ops
from pagedserve.worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.worker.layers.layernorm import RMSNorm
from pagedserve.worker.models.llama_config import LlamaModelConfig
from pagedserve.worker.models.llama_native import NativeDecodeStep
from pagedserve.worker.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorSlice,
    VocabParallelEmbedding,
)
from pagedserve.worker.layers.rotary import RotaryEmbedding
from pagedserve.worker.layers.tensor_parallel import ShardRange, TensorParallelGroup

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, num_kv_heads, head_size]


def _heads_to_rows(heads: ShardRange, head_size: int) -> ShardRange:
    return ShardRange(heads.full_size * head_size, heads.start * head_size, heads.size * head_size)


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: LlamaModelConfig, layer_index: int, *, tp: TensorParallelGroup,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        head_size = config.head_size
        heads = tp.even_shard(config.num_heads, "num_attention_heads")
        kv_heads = tp.kv_head_shard(config.num_kv_heads, config.num_heads)
        self.num_heads, self.num_kv_heads, self.head_size = heads.size, kv_heads.size, head_size
        self.q_size, self.kv_size = heads.size * head_size, kv_heads.size * head_size
        kv_rows = _heads_to_rows(kv_heads, head_size)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [_heads_to_rows(heads, head_size), kv_rows, kv_rows],
            bias=config.has_qkv_bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(_heads_to_rows(heads, head_size), config.hidden_size,
                                        bias=config.has_o_bias, tp=tp, dtype=dtype, device=device)
        self.attn = PagedAttention(heads.size, kv_heads.size, head_size, scale=head_size ** -0.5,
                                   sliding_window=config.sliding_window(layer_index))

    def forward(self, hidden: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache,
                metadata: AttentionMetadata) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        rotary.check_positions(metadata.positions, metadata.step_plans)
        if ops.rotary_write_kv(qkv, rotary.cos_sin, metadata.positions, metadata.slot_mapping, kv_cache[0],
                               kv_cache[1], self.num_heads, self.num_kv_heads):  # q and k rotated in place
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_size)  # [T, nh, hs]
            return self.o_proj(self.attn.attend(q, kv_cache, metadata))
        cos, sin = rotary.step_rows(metadata.positions, metadata.step_plans)  # [T, 1, hs] each
        qk_size = self.q_size + self.kv_size
        qk = RotaryEmbedding.rotate(qkv[:, :qk_size].view(num_tokens, -1, self.head_size), cos,
                                    sin)  # [T, nh + kvh, hs]: query and key heads rotated together
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]  # [T, nh, hs], [T, kvh, hs]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_size)  # [T, kvh, hs]
        out = self.attn(q, k, v, kv_cache, metadata)  # [T, nh * hs]
        return self.o_proj(out)

    def checkpoint_slices(self, param_prefix: str, checkpoint_prefix: str) -> list[TensorSlice]:
        qkv_names = [f"{checkpoint_prefix}.{name}" for name in ("q_proj", "k_proj", "v_proj")]
        return (self.qkv_proj.checkpoint_slices(f"{param_prefix}.qkv_proj", qkv_names)
                + self.o_proj.checkpoint_slices(f"{param_prefix}.o_proj", f"{checkpoint_prefix}.o_proj"))


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: LlamaModelConfig, *, tp: TensorParallelGroup, dtype: torch.dtype, device) -> None:
        super().__init__()
        inner = tp.even_shard(config.intermediate_size, "intermediate_size")
        self.inner_size = inner.size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inner, inner], bias=config.has_mlp_bias,
                                                 dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(inner, config.hidden_size, bias=config.has_mlp_bias, tp=tp,
                                           dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        activated = ops.silu_mul(self.gate_up_proj(hidden), self.inner_size)  # [T, inner_local], contiguous
        return self.down_proj(activated)

    def checkpoint_slices(self, param_prefix: str, checkpoint_prefix: str) -> list[TensorSlice]:
        names = [f"{checkpoint_prefix}.gate_proj", f"{checkpoint_prefix}.up_proj"]
        return (self.gate_up_proj.checkpoint_slices(f"{param_prefix}.gate_up_proj", names)
                + self.down_proj.checkpoint_slices(f"{param_prefix}.down_proj", f"{checkpoint_prefix}.down_proj"))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, config: LlamaModelConfig, layer_index: int, *, tp: TensorParallelGroup,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(config, layer_index, tp=tp, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = LlamaMLP(config, tp=tp, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding,
                kv_cache: KVCache, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden], residual [T, hidden] or None -> (mlp output, residual), each [T, hidden]."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, kv_cache, metadata)  # [T, hidden]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def checkpoint_slices(self, param_prefix: str, checkpoint_prefix: str) -> list[TensorSlice]:
        slices = []
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            slices += getattr(self, name).checkpoint_slices(f"{param_prefix}.{name}", f"{checkpoint_prefix}.{name}")
        return slices


class LlamaForCausalLM(torch.nn.Module):
    """`max_positions` bounds the positions the RoPE table covers (default: max_position_embeddings)."""

    lora_active = False  # a step with LoRA rows (pagedserve.worker.lora.slots): the layers' hooks add deltas

    def __init__(self, config: LlamaModelConfig, *, tp: TensorParallelGroup | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_positions: int | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup()
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype,
                                                   device=device)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config, i, tp=tp, dtype=dtype, device=device) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp, dtype=dtype, device=device,
                                      tied_to=self.embed_tokens if config.tie_word_embeddings else None)
        self.rotary = RotaryEmbedding(config.rope, max_positions or config.max_position_embeddings,
                                      dtype=dtype, device=device)
        first_attention = self.layers[0].self_attn
        self.num_kv_heads_per_rank = first_attention.num_kv_heads
        self.head_size = config.head_size

    @property
    def max_positions(self) -> int:
        return self.rotary.max_positions

    def forward(self, token_ids: torch.Tensor, metadata: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """token_ids [T] -> final-normed hidden states of the logits rows [num_sampled, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        native_step = None if self.lora_active else NativeDecodeStep.for_step(self, metadata, kv_caches)
        if native_step is not None and metadata.logits_indices.shape[0] == metadata.num_tokens:
            # every row samples (each is one sequence's decode): the embedding and the final norm too
            selected = native_step.final_hidden(token_ids)
            if selected is not None:
                return selected  # [num_sampled, hidden]
        hidden = self.embed_tokens(token_ids)  # [T, hidden]
        if native_step is not None:  # a few decodes in bfloat16: one native call for all the layers
            hidden, residual = native_step.run(hidden)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(hidden, residual, self.rotary, kv_cache, metadata)
        rows = metadata.logits_indices  # [num_sampled]
        selected, _ = self.norm(hidden.index_select(0, rows), residual.index_select(0, rows))
        return selected  # [num_sampled, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [num_sampled, hidden] -> logits [num_sampled, vocab_size] on rank 0, None elsewhere."""
        return self.lm_head(hidden)

    def checkpoint_slices(self) -> list[TensorSlice]:
        """Every tensor this rank reads from a Hugging Face checkpoint, and where it goes."""
        slices = self.embed_tokens.checkpoint_slices("embed_tokens", "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            slices += layer.checkpoint_slices(f"layers.{i}", f"model.layers.{i}")
        slices += self.norm.checkpoint_slices("norm", "model.norm")
        slices += self.lm_head.checkpoint_slices("lm_head", "lm_head.weight")
        return slices

    def is_ignorable_checkpoint_tensor(self, name: str) -> bool:
        """Tensors a checkpoint may carry that we do not read (rotary buffers, a tied LM head)."""
        return name.endswith("rotary_emb.inv_freq") or (self.lm_head.is_tied and name == "lm_head.weight")
