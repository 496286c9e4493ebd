"""Per-host parameters of the native kernels, chosen by measuring this machine once and kept beside
the library (<cache>/native/<build key>/tuning.json: the key names the sources, the compiler and
the CPU's flags, so another CPU or an edited kernel measures anew).

Today one parameter: how far ahead of its weight stream the few-rows linear kernel
(linear_rows.c) issues a software prefetch, in bytes, 0 meaning none (the hardware prefetchers
alone). Measured on SmolLM2-sized projections (rows of 576 bfloat16 values, 96 MiB, far beyond
any last-level cache) at one row of x with every core of the process's CPU set: each candidate's
median time over passes interleaved with the others'; a distance other than 0 is kept only when it beats no prefetch by
more than NOISE. On AMD Zen 4 the hardware prefetchers already follow the kernel's one stream
per thread at the measured read bandwidth, and a prefetch only adds loads. The distance changes
no result, only when the bytes arrive.

    tuning.apply(lib, folder)       # reads folder/tuning.json, or measures and writes it

PAGEDSERVE_ROW_PREFETCH=<bytes> sets the distance without measuring (and writes nothing).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

FILE_NAME = "tuning.json"
PREFETCH_ENV = "PAGEDSERVE_ROW_PREFETCH"
CANDIDATES = (0, 512, 1024, 2048, 4096, 8192)  # bytes ahead of the stream
NOISE = 0.05  # a prefetch must be this much faster than none to be kept
SIZE_IN = 576
WEIGHT_BYTES = 96 << 20
ROUNDS = 4  # interleaved, so a drift of the machine's bandwidth meets every candidate
PASSES = 3  # per candidate and round

_log = logging.getLogger(__name__)


def apply(lib, folder: Path) -> dict:
    """Sets the library's tuned parameters (from folder's file, the environment, or a measurement
    written to the file); returns them."""
    if os.environ.get(PREFETCH_ENV):
        params = {"linear_rows_prefetch": int(os.environ[PREFETCH_ENV]), "source": PREFETCH_ENV}
    else:
        path = folder / FILE_NAME
        params = _read(path)
        if params is None:
            params = measure(lib)
            _write(path, params)
            _log.info("native_kernels_tuned: %s", json.dumps(params))
    lib.linear_rows_set_prefetch(int(params["linear_rows_prefetch"]))
    return params


def measure(lib) -> dict:
    """Times linear_rows_bf16 at one row for every candidate distance; returns the parameters."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        weight = torch.ones(WEIGHT_BYTES // (2 * SIZE_IN), SIZE_IN, dtype=torch.bfloat16)  # [N, K]
        x = torch.ones(1, SIZE_IN, dtype=torch.bfloat16)  # [1, K]
        y = torch.empty(1, weight.shape[0], dtype=torch.bfloat16)  # [1, N]

        def one_pass() -> float:
            start = time.perf_counter()
            lib.linear_rows_bf16(x.data_ptr(), weight.data_ptr(), None, y.data_ptr(), 1, weight.shape[0], SIZE_IN)
            return time.perf_counter() - start

        for _ in range(3):
            one_pass()
        times = {}
        for _ in range(ROUNDS):
            for distance in CANDIDATES:
                lib.linear_rows_set_prefetch(distance)
                times.setdefault(distance, []).extend(one_pass() for _ in range(PASSES))
    finally:
        torch.set_num_threads(threads)
    medians = {distance: statistics.median(values) for distance, values in times.items()}
    best = min(medians, key=medians.get)
    if best != 0 and medians[best] > medians[0] * (1 - NOISE):
        best = 0
    return {"linear_rows_prefetch": best, "source": "measured",
            "gb_per_s": {str(d): round(WEIGHT_BYTES / t / 1e9, 2) for d, t in medians.items()},
            "threads": len(os.sched_getaffinity(0))}


def _read(path: Path) -> dict | None:
    try:
        params = json.loads(path.read_text())
        int(params["linear_rows_prefetch"])
        return params
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, params: dict) -> None:
    temporary = path.with_name(f".{FILE_NAME}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps(params, indent=1))
        os.replace(temporary, path)
    except OSError as error:  # a read-only cache: measured again next start
        _log.warning("native_kernels_tuning_not_saved: %s", error)
