"""Per-host parameters of the native kernels, chosen by measuring this machine once and kept beside
the library (<cache>/native/<build key>/tuning.json: the key names the sources, the compiler and
the CPU's flags, so another CPU or an edited kernel measures anew).

Six parameters. `linear_rows_prefetch`: how far ahead of its weight stream the few-rows linear
kernel (linear_rows.c) issues a software prefetch, in bytes, 0 meaning none (the hardware
prefetchers alone). Measured on SmolLM2-sized projections (rows of 576 bfloat16 values, 96 MiB, far beyond
any last-level cache) at one row of x with every core of the process's CPU set: a distance other
than 0 is kept only when it beats no prefetch by more than NOISE. On AMD Zen 4 the hardware prefetchers already follow the kernel's one stream
per thread at the measured read bandwidth, and a prefetch only adds loads. The distance changes
no result, only when the bytes arrive.

`linear_bf16_layout`: the layout the bfloat16 linear layers keep beside their dense weight for more
than two rows, "panels" (kernels/linear/panels.py, panel_linear.c) or "onednn" (oneDNN's blocked
layout, linear/onednn.py). Both are timed on SmolLM2's two projection shapes ([1536, 576] and
[576, 1536]) at LAYOUT_ROWS rows of x, interleaved; the panels are kept when they are faster than
oneDNN by more than NOISE at one of the row counts and not slower by more than NOISE at any, else
oneDNN (which has AMX tiles where the CPU has them). "panels" only where the
library has the panel kernel and torch has oneDNN's bfloat16 matmul to compare with.

`block_quant_prefetch`: the same for the 4-bit GGUF blocks' kernel at few rows of bfloat16
activations (block_quant_rows.c), timed at one row on Q4 weights of SmolLM2's projection shapes
(WEIGHT_BYTES of codes), with the same candidates and rule. On AMD Zen 4 that loop, which does
little work per byte, ran about a fifth faster with 2048-4096 bytes than with the hardware
prefetchers alone (18.4-21.7 against 15.8-18.3 GB/s of codes in three measurements).

`panel_prefetch`: with panels kept, how far ahead of each panel's loads the panel kernel's first
block of rows (the one that reads them from memory, panel_linear.c) prefetches, in bytes, for 1, 2,
4 and 8 rows of x ({"1": ..., "2": ..., "4": ..., "8": ...}; a block of 3-4 rows takes the
distance of 4, 5-8 that of 8). Each timed over SmolLM2's four projection shapes as panels, each its own allocation,
WEIGHT_BYTES in all, with PANEL_CANDIDATES and the same rule. On AMD Zen 4 the more rows the
block multiplies per load, the further behind the hardware prefetchers fall: 1,536 bytes ran one
row about 8 % faster than none, 2,048-3,072 bytes eight rows about 12 %; 4,096 and more lost.

`linear_bf16_few_rows`: with panels kept, what one or two rows multiply, "panels" or "rows" (the
row kernel on the dense weight, linear_rows.c): both timed at one row over SmolLM2's four
projection shapes, each its own allocation, WEIGHT_BYTES in all (far beyond the caches, as a decode
step reads its weights; the panels with the distance just measured), interleaved; the row kernel
is kept only when it beats the panels by more than NOISE. Within the noise the panels win: the
layers need them above two rows anyway, and without the row kernel they keep no dense copy beside
them. (The rule was the other way round, and on AMD Zen 4 a measurement that found the two equal
chose the row kernel, whose one-sequence forward then took 1.13-1.19x the panels' time.)

`block_quant_panel_rows`: up to how many rows bfloat16 activations multiply kept GGUF blocks through
the block kernel's decoded panels (block_quant_rows.c: each column block decoded once into the
panel layout in a buffer of the thread's, every block of 8 rows walking it) rather than through the
whole weight dequantized to bfloat16 and torch's matmul, as a prompt's prefill otherwise does. Both
are timed on Q4_1 weights of SmolLM2's four layer shapes at 64, 256 and 1024 rows, in turn; the
panels are kept up to the last row count before the first at which they are slower by more than
NOISE, at least the kernel's 32 rows. On AMD Zen 4 (2 vCPUs) the panels took 0.54x, 0.56x, 0.86x,
0.77x and 0.97x the dequantized path's time over a layer's four projections at 33, 64, 128, 256 and
512 rows, and at 2048 up to 1.18x: the activations are read again for every column block, from L2
while they fit. The two paths round the same bfloat16 weights; their float32 sums differ in order.

How every choice is timed: each candidate against the baseline (no prefetch; oneDNN for the
layout, the panels for few rows), the two run back to back, in turns first, ROUNDS times; the
median of those ratios decides (`_paired_times`). On 2 MiB pages where the host gives them
(pagedserve.huge_pages), as the worker keeps its weights. Measured as before (each candidate's
fastest pass, on torch's 4 KiB pages), on AMD EPYC (Zen 4) the row kernel's distance came out 512
in 16 of 30 builds, 0 in 12 and 1024 or 2048 in the other two, run to run on one host; alternated on
2 MiB pages, 512 read 64.5 % of torch.sum's bandwidth over SmolLM2's 120 projections where 0 read
74 %. A file measured another way or on other pages than the worker's now ("method",
"weight_pages") is measured anew.

    tuning.apply(lib, folder)       # reads folder/tuning.json, or measures and writes it

PAGEDSERVE_ROW_PREFETCH=<bytes> and PAGEDSERVE_BLOCK_PREFETCH=<bytes> set the distances,
PAGEDSERVE_BF16_LAYOUT=panels|onednn the layout, PAGEDSERVE_BLOCK_PANEL_ROWS=<rows> the decoded
panels' rows, without measuring them (and write nothing).
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
BLOCK_PREFETCH_ENV = "PAGEDSERVE_BLOCK_PREFETCH"
LAYOUT_ENV = "PAGEDSERVE_BF16_LAYOUT"
LAYOUTS = ("panels", "onednn")
LAYOUT_ROWS = (32, 256)
LAYOUT_SHAPES = ((1536, 576), (576, 1536))  # [N, K]
BLOCK_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [N, K] of a SmolLM2 layer
CANDIDATES = (0, 512, 1024, 2048, 4096, 8192)  # bytes ahead of the stream
PANEL_CANDIDATES = (0, 512, 1024, 1536, 2048, 3072)  # bytes ahead of each panel's stream
PANEL_PREFETCH_ROWS = (1, 2, 4, 8)  # measured at these rows; a block of R rows takes the first >= R
BLOCK_PANEL_ENV = "PAGEDSERVE_BLOCK_PANEL_ROWS"
BLOCK_PANEL_MIN_ROWS = 32  # the block kernel's rows at any measurement (block_quant.MAX_ROWS)
NOISE = 0.05  # a prefetch must be this much faster than none to be kept
SIZE_IN = 576
WEIGHT_BYTES = 96 << 20
ROUNDS = 15  # pairs of each candidate and the baseline (_paired_times)
METHOD = "paired"  # a tuning file of another method (or none) is measured anew

_log = logging.getLogger(__name__)


def apply(lib, folder: Path) -> dict:
    """Sets the library's tuned parameters (from folder's file, the environment, or a measurement
    written to the file); returns them."""
    overrides = {}
    if os.environ.get(PREFETCH_ENV):
        overrides[PREFETCH_ENV] = ("linear_rows_prefetch", int(os.environ[PREFETCH_ENV]))
    if os.environ.get(BLOCK_PREFETCH_ENV):
        overrides[BLOCK_PREFETCH_ENV] = ("block_quant_prefetch", int(os.environ[BLOCK_PREFETCH_ENV]))
    if os.environ.get(BLOCK_PANEL_ENV):
        overrides[BLOCK_PANEL_ENV] = ("block_quant_panel_rows",
                                      max(BLOCK_PANEL_MIN_ROWS, int(os.environ[BLOCK_PANEL_ENV])))
    if os.environ.get(LAYOUT_ENV) in LAYOUTS:
        overrides[LAYOUT_ENV] = ("linear_bf16_layout", os.environ[LAYOUT_ENV])
    elif os.environ.get(LAYOUT_ENV):
        _log.warning("native_kernels_layout_ignored: %s=%r is not one of %s; the measured layout is used",
                     LAYOUT_ENV, os.environ[LAYOUT_ENV], ", ".join(LAYOUTS))
    if len(overrides) == 4:
        params = {}
    else:
        path = folder / FILE_NAME
        params = _read(path)
        if params is None:
            params = measure(lib)
            _write(path, params)
            _log.info("native_kernels_tuned: %s", json.dumps(params))
    params = {**params, **dict(overrides.values())}
    if overrides:
        params["source"] = ",".join(overrides)
    lib.linear_rows_set_prefetch(int(params["linear_rows_prefetch"]))
    lib.block_quant_set_prefetch(int(params["block_quant_prefetch"]))
    set_panel_prefetch(lib, params.get("panel_prefetch", {}))
    lib._pagedserve_tuning = params
    return params


def set_panel_prefetch(lib, distances: dict) -> None:
    """Sets the panel kernel's distance for every block of 1-8 rows from those measured at
    PANEL_PREFETCH_ROWS ({"1": bytes, ...}; a missing one is 0)."""
    for rows in range(1, PANEL_PREFETCH_ROWS[-1] + 1):
        measured_at = next(r for r in PANEL_PREFETCH_ROWS if r >= rows)
        lib.panel_linear_set_prefetch(rows, int(distances.get(str(measured_at), 0)))


def linear_bf16_layout(lib) -> str:
    """The layout the library's host keeps for bfloat16 linear layers (module doc)."""
    return getattr(lib, "_pagedserve_tuning", {}).get("linear_bf16_layout", "onednn")


def panels_for_few_rows(lib) -> bool:
    """Whether one or two rows multiply the panels too (module doc), rather than the row kernel."""
    params = getattr(lib, "_pagedserve_tuning", {})
    return params.get("linear_bf16_layout") == "panels" and params.get("linear_bf16_few_rows") == "panels"


def block_panel_rows(lib) -> int:
    """Up to how many rows bfloat16 activations multiply kept GGUF blocks through the block kernel's
    decoded panels rather than a dequantized copy and torch's matmul (module doc)."""
    return int(getattr(lib, "_pagedserve_tuning", {}).get("block_quant_panel_rows", BLOCK_PANEL_MIN_ROWS))


def measure(lib) -> dict:
    """Measures every parameter on this host; returns them."""
    from pagedserve.kernels.native import block_tuning  # which reads this module's constants and timing

    params = {**measure_prefetch(lib), **block_tuning.measure_block_prefetch(lib), **measure_layout(lib),
              **block_tuning.measure_block_panel_rows(lib)}
    lib.linear_rows_set_prefetch(int(params["linear_rows_prefetch"]))
    if params["linear_bf16_layout"] == "panels":
        weights = _projection_weights()  # packed once for both measurements
        params.update(measure_panel_prefetch(lib, weights))
        params.update(measure_few_rows(lib, weights))
    else:
        params.update({"panel_prefetch": {}, "linear_bf16_few_rows": "rows"})
    return params


def _paired_times(baseline, candidates: dict) -> tuple[dict, dict]:
    """{name: run()}, one of them the baseline -> ({name: the median over ROUNDS of its time over
    the baseline's, the two run back to back}, {name: seconds of its fastest run}), on every core
    of the process's CPU set.

    Each round runs every other candidate once beside one run of the baseline, the two in turns
    first, after one warm-up run each. A host's read bandwidth can change by half within seconds
    (another job's traffic, the memory controller's state): a ratio of two neighbouring runs meets
    the same state, where the fastest runs of each candidate came from whichever moment was
    quickest when it ran, so a change of state in the middle of a measurement chose the candidates
    that ran after it. The median drops the pairs that straddle such a change; a process that
    takes the cores for a moment only spoils the pairs it meets."""
    import torch

    def timed(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        for run in candidates.values():
            run()
        times = {name: [] for name in candidates}
        ratios = {name: [] for name in candidates if name != baseline}
        for round_index in range(ROUNDS):
            for name in ratios:
                first, second = (baseline, name) if round_index % 2 == 0 else (name, baseline)
                pair = {first: timed(candidates[first])}
                pair[second] = timed(candidates[second])
                times[baseline].append(pair[baseline])
                times[name].append(pair[name])
                ratios[name].append(pair[name] / pair[baseline])
    finally:
        torch.set_num_threads(threads)
    medians = {name: statistics.median(values) for name, values in ratios.items()}
    return {baseline: 1.0, **medians}, {name: min(values) for name, values in times.items()}


def _on_huge_pages(tensor):
    """A copy of the tensor on 2 MiB pages where the host gives them (pagedserve.huge_pages), as the
    worker keeps the weights it serves: the hardware prefetchers stop at every 4 KiB page's end and
    run on across 2 MiB ones, so a software prefetch measured on the one can be wrong on the other."""
    from pagedserve.huge_pages import huge_page_buffer

    copy = huge_page_buffer(tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
    return copy.copy_(tensor)


def weight_pages() -> str:
    """The pages the measurements' weights are on: "2 MiB" where the host gives them, else "4 KiB"."""
    from pagedserve.huge_pages import available

    return "2 MiB" if available() else "4 KiB"


def _row_weight():
    """The prefetch measurement's weight [N, SIZE_IN] (WEIGHT_BYTES), one row of x and its output."""
    import torch

    weight = _on_huge_pages(torch.ones(WEIGHT_BYTES // (2 * SIZE_IN), SIZE_IN, dtype=torch.bfloat16))
    return weight, torch.ones(1, SIZE_IN, dtype=torch.bfloat16), torch.empty(1, weight.shape[0], dtype=torch.bfloat16)


def _projection_weights() -> list:
    """SmolLM2's four projection shapes in bfloat16, each its own allocation, WEIGHT_BYTES in all
    (far beyond the caches, streams that restart at every projection, as a decode step reads its
    weights): [(dense [N, K], its panels), ...]."""
    import torch

    from pagedserve.kernels.linear import panels

    layer_bytes = sum(2 * n * k for n, k in BLOCK_SHAPES)
    dense = [_on_huge_pages(torch.full((n, k), 0.5, dtype=torch.bfloat16))
             for _ in range(max(1, WEIGHT_BYTES // layer_bytes)) for n, k in BLOCK_SHAPES]
    return [(weight, _on_huge_pages(panels.pack(weight).data)) for weight in dense]


def _weights_pass(lib, weights: list, rows: int, kernel: str):
    """A pass of `rows` rows of x over every weight, with the panel kernel or the row kernel."""
    import torch

    inputs = {k: torch.ones(rows, k, dtype=torch.bfloat16) for _, k in BLOCK_SHAPES}
    y = torch.empty(rows, max(n for n, _ in BLOCK_SHAPES), dtype=torch.bfloat16)

    def run() -> None:
        for weight, packed in weights:
            n, k = weight.shape
            if kernel == "panels":
                lib.panel_linear_bf16(inputs[k].data_ptr(), packed.data_ptr(), None, y.data_ptr(), rows, n, k)
            else:
                lib.linear_rows_bf16(inputs[k].data_ptr(), weight.data_ptr(), None, y.data_ptr(), rows, n, k)
    return run


def measure_few_rows(lib, weights: list | None = None) -> dict:
    """Times the row kernel against the panels at one row (module doc) over _projection_weights()."""
    weights = weights or _projection_weights()
    ratios, times = _paired_times("panels", {kernel: _weights_pass(lib, weights, 1, kernel)
                                             for kernel in ("panels", "rows")})
    choice = "rows" if ratios["rows"] < 1 - NOISE else "panels"
    num_bytes = sum(weight.numel() * 2 for weight, _ in weights)
    return {"linear_bf16_few_rows": choice, "few_rows_time_ratio": round(ratios["rows"], 3),
            "few_rows_gb_per_s": {kernel: round(num_bytes / t / 1e9, 2) for kernel, t in times.items()}}


def measure_panel_prefetch(lib, weights: list | None = None) -> dict:
    """Times panel_linear_bf16 at each of PANEL_PREFETCH_ROWS rows for every candidate distance
    over _projection_weights() (module doc), and leaves the library set to the distances kept."""
    weights = weights or _projection_weights()
    num_bytes = sum(weight.numel() * 2 for weight, _ in weights)
    distances, gb_per_s = {}, {}
    for rows in PANEL_PREFETCH_ROWS:
        run = _weights_pass(lib, weights, rows, "panels")

        def at(distance: int, rows=rows, run=run):
            def timed_run() -> None:
                lib.panel_linear_set_prefetch(rows, distance)
                run()
            return timed_run

        ratios, times = _paired_times(0, {distance: at(distance) for distance in PANEL_CANDIDATES})
        distances[str(rows)] = _best_distance(ratios)
        gb_per_s[str(rows)] = {str(d): round(num_bytes / t / 1e9, 2) for d, t in times.items()}
    set_panel_prefetch(lib, distances)
    return {"panel_prefetch": distances, "panel_gb_per_s": gb_per_s}


def _best_distance(ratios: dict) -> int:
    """The distance of the lowest time over no prefetch's ({distance: ratio}, 0's being 1), or 0
    unless that beats no prefetch by more than NOISE."""
    best = min(ratios, key=ratios.get)
    return best if ratios[best] <= 1 - NOISE else 0


def measure_prefetch(lib) -> dict:
    """Times linear_rows_bf16 at one row for every candidate distance."""
    weight, x, y = _row_weight()

    def at(distance: int):
        def run() -> None:
            lib.linear_rows_set_prefetch(distance)
            lib.linear_rows_bf16(x.data_ptr(), weight.data_ptr(), None, y.data_ptr(), 1, weight.shape[0], SIZE_IN)
        return run

    ratios, times = _paired_times(0, {distance: at(distance) for distance in CANDIDATES})
    best = _best_distance(ratios)
    return {"linear_rows_prefetch": best, "source": "measured", "method": METHOD, "weight_pages": weight_pages(),
            "gb_per_s": {str(d): round(WEIGHT_BYTES / t / 1e9, 2) for d, t in times.items()},
            "threads": len(os.sched_getaffinity(0))}


def measure_layout(lib) -> dict:
    """Times panel_linear_bf16 against oneDNN's prepacked matmul (module doc)."""
    import torch

    from pagedserve.kernels.linear import onednn, panels

    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in LAYOUT_SHAPES]
    if not (lib.panel_linear_available() and onednn.can_prepack(weights[0])):
        return {"linear_bf16_layout": "onednn", "layout_ms": {}}
    panel_weights = [panels.pack(w) for w in weights]
    onednn_weights = [onednn.prepack_linear_weight(w) for w in weights]
    times, ratios = {}, {}
    for rows in LAYOUT_ROWS:
        inputs = [torch.randn(rows, k).to(torch.bfloat16) for _, k in LAYOUT_SHAPES]
        by_layout, times[rows] = _paired_times("onednn", {
            "onednn": lambda: [onednn.prepacked_linear(x, w, None) for x, w in zip(inputs, onednn_weights)],
            "panels": lambda: [panels.panel_linear(x, w, None, lib) for x, w in zip(inputs, panel_weights)]})
        ratios[rows] = by_layout["panels"]
    wins = all(ratio < 1 + NOISE for ratio in ratios.values()) and any(ratio < 1 - NOISE for ratio in ratios.values())
    return {"linear_bf16_layout": "panels" if wins else "onednn",
            "layout_ms": {str(rows): {layout: round(t * 1e3, 3) for layout, t in pair.items()}
                          for rows, pair in times.items()}}


def _read(path: Path) -> dict | None:
    try:
        params = json.loads(path.read_text())
        if params.get("method") != METHOD or params.get("weight_pages") != weight_pages():
            return None  # measured another way, or on other pages than the worker's now: anew
        int(params["linear_rows_prefetch"])
        int(params["block_quant_prefetch"])
        int(params["block_quant_panel_rows"])
        if params["linear_bf16_layout"] not in LAYOUTS or params["linear_bf16_few_rows"] not in ("rows", "panels"):
            return None
        if params["linear_bf16_layout"] == "panels":
            [int(params["panel_prefetch"][str(rows)]) for rows in PANEL_PREFETCH_ROWS]
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
