"""Per-layer fp8 KV scales calibrated on a prefill (opt-in; the default scale is 1.0).

An fp8 cache stores K / k_scale and V / v_scale (pagedserve.kernels.cache.kv_dtype). With 1.0,
values below the format's smallest normal (2^-6 for e4m3) lose relative precision, and a model's
first layer can hold many of its V entries there (docs/quantization.md). `calibrate_kv_scales` runs one prefill of the
given tokens, records each layer's largest |K| and |V| before they are stored, and sets

    k_scale = margin * max|K| / fp8_max        v_scale = margin * max|V| / fp8_max

so the largest value seen uses 1 / margin of the range and small values move into the normal
range. The scales then stay fixed. Calibrating on a fixed, deterministic token sequence keeps a
model's outputs reproducible; calibrating on live traffic would make every later output depend
on the first request, which is why the runner does not do it by itself.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cache.kv_dtype import fp8_max, is_fp8
from pagedserve.worker.layers.attention import PagedAttention
from pagedserve.worker.model_runner import ModelRunner, RunnerStateError
from pagedserve.testing.prompt_scoring import sequence_logits

DEFAULT_MARGIN = 2.0


def calibrate_kv_scales(runner: ModelRunner, token_ids: list[int], margin: float = DEFAULT_MARGIN) -> list[
        tuple[float, float]]:
    """Sets every layer's (k_scale, v_scale) from one prefill of token_ids; returns them.

    Uses the first blocks of the runner's pool as scratch: call it before serving.
    """
    if runner.model is None or runner.cache is None:
        raise RunnerStateError("load() and init_cache() must run first")
    if not is_fp8(runner.kv_cache_dtype):
        raise ValueError(f"KV scales apply to fp8 caches, not {runner.kv_cache_dtype}")
    if margin < 1.0:
        raise ValueError(f"margin must be >= 1, not {margin}")
    attentions = [module for module in runner.model.modules() if isinstance(module, PagedAttention)]
    maxima = {id(module): [0.0, 0.0] for module in attentions}

    def record(module, args) -> None:
        _, key, value = args[:3]
        seen = maxima[id(module)]
        seen[0] = max(seen[0], float(key.abs().max()))
        seen[1] = max(seen[1], float(value.abs().max()))

    hooks = [module.register_forward_pre_hook(record) for module in attentions]
    try:
        for module in attentions:
            module.k_scale = module.v_scale = 1.0
        sequence_logits(runner, token_ids)
    finally:
        for hook in hooks:
            hook.remove()
    limit = fp8_max(runner.kv_cache_dtype)
    scales = []
    for module in attentions:
        key_max, value_max = maxima[id(module)]
        module.k_scale = max(key_max, torch.finfo(torch.float32).tiny) * margin / limit
        module.v_scale = max(value_max, torch.finfo(torch.float32).tiny) * margin / limit
        scales.append((module.k_scale, module.v_scale))
    return scales
