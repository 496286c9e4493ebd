"""Validated configuration of one worker rank: its model, device, KV memory and links (no torch).

The one definition of `pagedserve worker`'s settings; the flags (and what `serve` forwards) are
derived from the fields' metadata (pagedserve.config.flags).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.adapters.lora_config import LoraConfig
from pagedserve.config.flags import ConfigError, option, require
from pagedserve.config.shared_options import (
    DEFAULT_DIST_INIT_ADDRESS, SPECULATIVE_QUANTIZATIONS, allow_insecure_internal_transport_option, block_size_option,
    kv_cache_dir_option, model_option, plan_address_option, result_address_option, speculative_model_option,
    speculative_quantization_option, tensor_parallel_size_option, enable_lora_option, max_loras_option,
    max_lora_rank_option, max_cpu_loras_option,
)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
DISK_STAGING_GIB = 0.25  # the host tier's default with a disk tier: blocks read from disk land there first
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    model_path: str = model_option()
    rank: int = option(0, metavar="R", help="this process's tensor-parallel rank, 0 to N-1")
    world_size: int = tensor_parallel_size_option()
    plan_address: str = plan_address_option()
    result_address: str = result_address_option()
    allow_insecure_internal_transport: bool = allow_insecure_internal_transport_option()
    dist_init_address: str = option(DEFAULT_DIST_INIT_ADDRESS, metavar="tcp://HOST:PORT",
                                    help="rendezvous of the tensor-parallel ranks: tcp://RANK0_HOST:PORT")
    dist_timeout_s: float = option(60.0, flag="--dist-timeout", metavar="SECONDS",
                                   help="how long a rank waits in a collective (or the rendezvous) for the others")
    num_threads: int | None = option(None, metavar="N",
                                     help="torch CPU threads of this rank (default: torch's choice)")
    block_size: int = block_size_option()
    device: str = option("auto", choices=DEVICES, serve=True, help="where the model runs (auto: cuda if present)")
    dtype: str = option("auto", choices=DTYPES, serve=True,
                        help="weights and KV cache (auto: the checkpoint's dtype on CUDA; on CPU bfloat16 where the "
                             "cores compute it natively (AVX-512 BF16, AMX), else float32)")
    swap_space_gib: float | None = option(
        None, flag="--swap-space", metavar="GIB", serve=True,
        help="CPU swap space per rank for preempted KV blocks (default: 4 on CUDA; 0 on a CPU device, "
             "where preempted requests are recomputed)")
    kv_cache_memory_gib: float | None = option(
        None, flag="--kv-cache-memory", metavar="GIB", serve=True,
        help="memory for the KV pool per rank (default: derived from the device)")
    kv_offloading_size_gib: float | None = option(
        None, flag="--kv-offloading-size", metavar="GIB", serve=True,
        help="host tier of the prefix cache per rank: KV blocks evicted from the device pool are kept in this much "
             "host memory and loaded back on a prefix hit (default 0, or 0.25 with --kv-cache-dir, where it "
             "stages the blocks read from disk; on a CPU device it is the same RAM as the pool)")
    kv_cache_dir: str | None = kv_cache_dir_option()
    quantization: str = option("auto", choices=QUANTIZATIONS, serve=True,
                               help="weight-only quantization of the linear layers: auto (default) keeps a GGUF's "
                                    "Q4_0/Q4_1/Q8_0 weights exactly as the file has them (float16 scales and "
                                    "minimums, native block kernels) and loads any other checkpoint as none; none "
                                    "dequantizes a GGUF to --dtype; int8 per output channel; int4 per group")
    quantization_group_size: int | None = option(
        None, metavar="G", serve=True, help="int4 group size along the input dimension (default 32)")
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES, serve=True,
                                 help="KV cache element type (auto: the model's dtype); fp8 holds 2-4x the "
                                      "blocks in the same memory")
    speculative_model: str | None = speculative_model_option()
    speculative_quantization: str = speculative_quantization_option()
    enable_lora: bool = enable_lora_option()
    max_loras: int = max_loras_option()
    max_lora_rank: int = max_lora_rank_option()
    max_cpu_loras: int | None = max_cpu_loras_option()

    @property
    def host_tier_gib(self) -> float:
        """--kv-offloading-size, or its default: 0 without a disk tier, else DISK_STAGING_GIB."""
        if self.kv_offloading_size_gib is not None:
            return self.kv_offloading_size_gib
        return DISK_STAGING_GIB if self.kv_cache_dir else 0.0

    def __post_init__(self) -> None:
        require(self.world_size >= 1, "world_size", f"must be >= 1, not {self.world_size}")
        require(0 <= self.rank < self.world_size, "rank", f"{self.rank} is outside world size {self.world_size}")
        require(self.dist_timeout_s > 0, "dist_timeout_s", "must be positive")
        require(self.num_threads is None or self.num_threads > 0, "num_threads", "must be positive")
        require(self.block_size > 0, "block_size", "must be positive")
        require(self.device in DEVICES, "device", f"must be one of {', '.join(DEVICES)}")
        require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        require(self.swap_space_gib is None or self.swap_space_gib >= 0, "swap_space_gib", "must be >= 0")
        require(self.kv_cache_memory_gib is None or self.kv_cache_memory_gib > 0, "kv_cache_memory_gib",
                "must be positive")
        require(self.kv_offloading_size_gib is None or self.kv_offloading_size_gib >= 0, "kv_offloading_size_gib",
                "must be >= 0")
        require(self.kv_cache_dir is None or bool(self.kv_cache_dir), "kv_cache_dir", "must name a folder when given")
        require(not (self.kv_cache_dir and self.kv_offloading_size_gib == 0), "kv_offloading_size_gib",
                "must be > 0 with --kv-cache-dir: blocks read from disk are staged in the host tier")
        require(self.quantization in QUANTIZATIONS, "quantization", f"must be one of {', '.join(QUANTIZATIONS)}")
        require(self.quantization_group_size is None or self.quantization_group_size > 0,
                "quantization_group_size", "must be positive")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        require(self.speculative_model is None or bool(self.speculative_model), "speculative_model",
                "must name a model when given")
        require(self.speculative_quantization in SPECULATIVE_QUANTIZATIONS, "speculative_quantization",
                f"must be one of {', '.join(SPECULATIVE_QUANTIZATIONS)}")
        if self.enable_lora:
            try:
                self.lora_config
            except ValueError as exc:
                raise ConfigError("max_loras", str(exc)) from None

    @property
    def lora_config(self) -> LoraConfig | None:
        """The adapter limits with --enable-lora, else None (raises ValueError when out of range)."""
        if not self.enable_lora:
            return None
        return LoraConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras)
