"""The LoRA limits every process agrees on (--max-loras, --max-lora-rank, --max-cpu-loras); no torch.

    max_loras       adapters resident in one step: the worker's slots, the scheduler's slot table
    max_lora_rank   the largest rank an adapter may have (refused above it)
    max_cpu_loras   adapters each worker keeps loaded in host memory, slots included (LRU beyond)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoraConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, not {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, not {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                             f"({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
