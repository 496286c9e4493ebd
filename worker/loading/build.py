"""Builds one rank's shard of a Llama-family model and fills it from a checkpoint: the same steps
for the served (target) model and for a draft model of draft-model speculation.

    config ─> LlamaForCausalLM(config, tp, dtype, device, max_positions)   this rank's shard
          ─> load_weights        checkpoint slices (safetensors or GGUF; GGUF's Q4/Q8 kept when asked)
          ─> quantize_model      --quantization int8|int4 (or the draft's own)
          ─> prepack_model       bfloat16 CPU weights prepacked once for oneDNN
          ─> move_to_huge_pages  on the CPU, every weight moved onto 2 MiB pages (pagedserve/huge_pages.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.worker.loading.hf_checkpoint import load_weights
from pagedserve.huge_pages import move_to_huge_pages
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.llama_config import LlamaModelConfig
from pagedserve.worker.loading.prepacked_weights import prepack_model
from pagedserve.worker.quantization.quantizers import QuantizationConfig
from pagedserve.worker.quantization.linear import quantize_model
from pagedserve.worker.layers.tensor_parallel import TensorParallelGroup


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    num_checkpoint_bytes_read: int
    num_prepacked_bytes: int

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied LM head counted once) and their prepacked copies."""
        parameters = sum(param.numel() * param.element_size() for param in self.model.parameters())
        return parameters + self.num_prepacked_bytes


def load_model(path: str | Path, config: LlamaModelConfig, *, tp: TensorParallelGroup, dtype: torch.dtype,
               device: torch.device, max_positions: int, quantization: QuantizationConfig) -> LoadedModel:
    """This rank's shard of the model at `path`, loaded, quantized, prepacked and in eval mode."""
    model = LlamaForCausalLM(config, tp=tp, dtype=dtype, device=device, max_positions=max_positions)
    num_bytes_read = load_weights(model, path, keep_quantized=quantization.keeps_checkpoint_quantization)
    quantize_model(model, quantization)
    num_prepacked_bytes = prepack_model(model)
    if device.type == "cpu":
        move_to_huge_pages(model)
    model.eval()
    return LoadedModel(model, num_bytes_read, num_prepacked_bytes)
