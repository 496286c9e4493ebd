"""What `serve` checks before it starts anything, so a model that cannot run with the flags given
is a message and exit code 2 at once, not workers that fail, are restarted and fail again.

    tensor parallelism  the attention heads and the MLP width divide by the ranks; the KV heads
                        too, or (fewer KV heads than ranks) the ranks are a multiple of them and
                        each KV head is replicated (pagedserve.worker.layers.tensor_parallel's rules)
    max_model_len       at most the model's max_position_embeddings
    memory              on a CPU device, explicit --kv-cache-memory, --num-kv-blocks x the block
                        size in bytes, and --swap-space (any device), per rank, with the weights,
                        within the host's memory (pagedserve.host_memory); the weights counted at
                        the dtype they will run in (--dtype, "auto": on a CPU device bfloat16
                        where the cores compute it natively, else float32; the checkpoint's on CUDA)

No torch: the model is read by pagedserve.checkpoints.model_config, the sizes are arithmetic. `--device auto`
counts as CUDA where the NVIDIA driver is loaded (/proc/driver/nvidia).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedserve.cpu_features import cpu_auto_dtype
from pagedserve.host_memory import GIB, cpu_kv_pool_bytes, total_memory
from pagedserve.checkpoints.model_config import ModelInfo

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}
NVIDIA_DRIVER = Path("/proc/driver/nvidia")


class PreflightError(ValueError):
    """The model cannot run with these flags (serve exits 2 with this message)."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """The flags of `serve` the checks need (ServeConfig.deployment)."""

    tensor_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    swap_space_gib: float | None = None
    kv_offloading_size_gib: float | None = None  # the host KV tier per rank (host memory everywhere)

    @property
    def device_type(self) -> str:
        if self.device == "auto":
            return "cuda" if NVIDIA_DRIVER.exists() else "cpu"
        return self.device


def check_deployment(model: ModelInfo, deployment: Deployment, *, total_bytes: int | None = None) -> None:
    """Raises PreflightError naming every problem found."""
    problems = tensor_parallel_problems(model, deployment.tensor_parallel_size)
    if deployment.max_model_len is not None and deployment.max_model_len > model.max_position_embeddings:
        problems.append(f"--max-model-len {deployment.max_model_len} is more than the model's "
                        f"max_position_embeddings ({model.max_position_embeddings})")
    if not problems:  # the sizes below assume a valid split
        problems += memory_problems(model, deployment, total_memory() if total_bytes is None else total_bytes)
    if problems:
        raise PreflightError(f"{model.name or model.path}: " + "; ".join(problems))


def _can_split(model: ModelInfo, num_ranks: int) -> list[str]:
    problems = []
    if model.num_heads % num_ranks:
        problems.append(f"num_attention_heads ({model.num_heads}) is not divisible by "
                        f"--tensor-parallel-size {num_ranks}")
    if model.num_kv_heads >= num_ranks and model.num_kv_heads % num_ranks:
        problems.append(f"num_key_value_heads ({model.num_kv_heads}) is not divisible by "
                        f"--tensor-parallel-size {num_ranks}")
    if model.num_kv_heads < num_ranks and num_ranks % model.num_kv_heads:
        problems.append(f"--tensor-parallel-size {num_ranks} is not a multiple of num_key_value_heads "
                        f"({model.num_kv_heads}), so its KV heads cannot be replicated evenly")
    if model.intermediate_size is not None and model.intermediate_size % num_ranks:
        problems.append(f"intermediate_size ({model.intermediate_size}) is not divisible by "
                        f"--tensor-parallel-size {num_ranks}")
    return problems


def tensor_parallel_problems(model: ModelInfo, num_ranks: int) -> list[str]:
    """Why the model cannot be split across num_ranks ranks (empty: it can), with the sizes that work."""
    problems = _can_split(model, num_ranks)
    if problems:
        sizes = [n for n in range(1, model.num_heads + 1) if not _can_split(model, n)]
        problems[-1] += f" (sizes that work for this model: {', '.join(map(str, sizes))})"
    return problems


def _dtype_bytes(model: ModelInfo, deployment: Deployment) -> tuple[int, int]:
    """(bytes per value as the model runs, bytes per value in the checkpoint)."""
    stored = DTYPE_BYTES.get(model.torch_dtype.removeprefix("torch."), 4)
    if deployment.dtype != "auto":
        return DTYPE_BYTES[deployment.dtype], stored
    return (stored if deployment.device_type == "cuda" else DTYPE_BYTES[cpu_auto_dtype()]), stored


def weight_bytes(model: ModelInfo, deployment: Deployment) -> int:
    """The replica's weights in memory: the checkpoint's safetensors at the dtype they run in."""
    if model.path is None:
        return 0
    running, stored = _dtype_bytes(model, deployment)
    on_disk = sum(path.stat().st_size for path in Path(model.path).glob("*.safetensors"))
    return on_disk * running // stored


def block_bytes(model: ModelInfo, deployment: Deployment) -> int:
    """One KV block of one rank: keys and values of every layer."""
    running, _ = _dtype_bytes(model, deployment)
    kv_heads = max(1, model.num_kv_heads // deployment.tensor_parallel_size)
    return 2 * model.num_layers * deployment.block_size * kv_heads * model.head_size * running


def memory_problems(model: ModelInfo, deployment: Deployment, total_bytes: int) -> list[str]:
    """Explicit sizes that, with the weights, take all of the host's memory (the worker's rule,
    worker/memory_budget.py, with the weights estimated from the checkpoint's files)."""
    ranks = deployment.tensor_parallel_size
    is_cpu = deployment.device_type == "cpu"
    weights = weight_bytes(model, deployment) if is_cpu else 0
    swap = int((deployment.swap_space_gib or 0.0) * GIB) * ranks
    host_tier = int((deployment.kv_offloading_size_gib or 0.0) * GIB) * ranks
    host_flags = " and ".join(flag for flag, value in (("--swap-space", deployment.swap_space_gib),
                                                        ("--kv-offloading-size", deployment.kv_offloading_size_gib))
                              if value is not None)
    pools: dict[str, int] = {}  # the flag that sets the pool -> the pool's bytes on this host
    if is_cpu and deployment.kv_cache_memory_gib is not None:
        pools["--kv-cache-memory"] = int(deployment.kv_cache_memory_gib * GIB) * ranks
    if is_cpu and deployment.num_kv_blocks is not None:
        pools["--num-kv-blocks"] = deployment.num_kv_blocks * block_bytes(model, deployment) * ranks
    if host_flags and not pools:
        pools[host_flags] = cpu_kv_pool_bytes(total_bytes, weights, ranks) * ranks if is_cpu else 0
    elif host_flags:
        pools = {f"{flag} with {host_flags}": pool for flag, pool in pools.items()}
    problems = []
    for flags, pool in pools.items():
        if weights + pool + swap + host_tier < total_bytes:
            continue
        parts = [f"{name} {_gib(size)}" for name, size in (("weights", weights), ("KV pool", pool),
                                                           ("swap space", swap), ("host KV tier", host_tier)) if size]
        problems.append(f"{flags} does not fit this host: {' + '.join(parts)} for {ranks} rank(s) "
                        f"is more than its {_gib(total_bytes)} of memory")
    return problems


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
