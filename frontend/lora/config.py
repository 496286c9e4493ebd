"""The frontend's LoRA settings (nested in FrontendConfig; `serve` forwards them all).

Runtime loading reads adapter folders on the frontend's host, so it is off unless
--allow-runtime-lora-updating is given (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING), and then only
with an API key (--api-key or $PAGEDSERVE_API_KEY), which guards those endpoints like all others.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config.flags import option, require
from pagedserve.config.shared_options import enable_lora_option, max_lora_rank_option
from pagedserve.frontend.lora.registry import parse_lora_modules


@dataclass(frozen=True, slots=True)
class LoraFrontendConfig:
    enable_lora: bool = enable_lora_option()
    lora_modules: str = option(
        "", metavar="NAME=PATH", serve=True, is_repeatable=True, takes_several=True,
        help="LoRA adapters served by name: PEFT folders (adapter_config.json + adapter_model.safetensors); "
             "HTTP `model` and gRPC `adapter` name them (with --enable-lora)")
    max_lora_rank: int = max_lora_rank_option()
    allow_runtime_lora_updating: bool = option(
        False, serve=True,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs an API key: they read "
             "folders on this host)")

    def __post_init__(self) -> None:
        try:
            modules = parse_lora_modules(self.lora_modules)
        except ValueError as exc:
            require(False, "lora_modules", str(exc))
        require(self.enable_lora or not modules, "lora_modules", "needs --enable-lora")
        require(self.enable_lora or not self.allow_runtime_lora_updating, "allow_runtime_lora_updating",
                "needs --enable-lora")
        require(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")

    @property
    def modules(self) -> list[tuple[str, str]]:
        return parse_lora_modules(self.lora_modules)
