"""PEFT LoRA adapters for tests and benchmarks, and their merged references (needs peft).

    folder = build_peft_adapter(base, out, seed=1)        # rank 8 on q/k/v/o/gate/up/down
    merged = merged_model(base, folder)                     # transformers model, merge_and_unload()

lora_B is drawn non-zero (PEFT initialises it to zero, which would make every adapter the base
model), scaled so the delta moves greedy choices without swamping the base weights.
"""

from __future__ import annotations

from pathlib import Path

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_peft_adapter(base: str | Path, out: str | Path, *, seed: int, rank: int = 8, alpha: int = 16,
                       b_std: float = 0.1, target_modules: list[str] | None = None, **load_options) -> Path:
    return build_peft_adapters(base, [(out, seed)], rank=rank, alpha=alpha, b_std=b_std,
                               target_modules=target_modules, **load_options)[0]


def build_peft_adapters(base: str | Path, outs: list[tuple[str | Path, int]], *, rank: int = 8, alpha: int = 16,
                        b_std: float = 0.1, target_modules: list[str] | None = None,
                        **load_options) -> list[Path]:
    """One adapter per (folder, seed), the base model loaded once (load_options go to
    from_pretrained, e.g. gguf_file=)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **load_options)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or ALL_PROJECTIONS,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    folders = []
    for out, seed in outs:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_A" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
                elif "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * b_std)
        folders.append(Path(out))
        peft_model.save_pretrained(folders[-1])
    return folders


def merged_model(base: str | Path, adapter: str | Path | None, **load_options):
    """The base model with the adapter merged into its weights (the base alone for None), eval, float32."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **load_options)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.generation_config.eos_token_id = None
    return model.eval()


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    import torch

    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=0)
    return output[0, len(prompt):].tolist()
