"""The GGUF block kernel's tuned parameters (block_quant_rows.c), measured: the distance its codes
are prefetched at one row (`block_quant_prefetch`), and up to how many rows of bfloat16 activations
its decoded panels multiply the blocks (`block_quant_panel_rows`). kernels/native/tuning.py says
what each is, how a choice is timed and where it is kept; its measure() calls these. The module's
constants, the weights' pages and the timing are tuning.py's, read when a measurement runs.
"""

from __future__ import annotations

from pagedserve.kernels.native import tuning

BLOCK_PANEL_ROWS = (64, 256, 1024)  # row counts at which the decoded panels are timed
BF16_CODE = 1  # abi.DTYPE_CODES[torch.bfloat16]


def measure_block_prefetch(lib) -> dict:
    """Times block_quant_rows_bf16 at one row for every candidate distance, over 4-bit weights of
    SmolLM2's four projection shapes, each its own allocation, tuning.WEIGHT_BYTES of codes in all (one
    array of that size hides what the prefetch does: the hardware prefetchers ramp up once, not at
    every projection)."""
    import torch

    if not lib.block_quant_rows_bf16_available():
        return {"block_quant_prefetch": 0, "block_gb_per_s": {}}
    layer_bytes = sum(n * k // 2 for n, k in tuning.BLOCK_SHAPES)
    weights = [(tuning._on_huge_pages(torch.full((n, k // 2), 0x5A, dtype=torch.uint8)),
                tuning._on_huge_pages(torch.full((n, k // 32), 0x3C00, dtype=torch.int16)),  # float16 1.0: scales
                tuning._on_huge_pages(torch.full((n, k // 32), 0x3C00, dtype=torch.int16)), n, k)  # and minimums
               for _ in range(max(1, tuning.WEIGHT_BYTES // layer_bytes)) for n, k in tuning.BLOCK_SHAPES]
    inputs = {k: torch.ones(1, k, dtype=torch.bfloat16) for _, k in tuning.BLOCK_SHAPES}
    y = torch.empty(1, max(n for n, _ in tuning.BLOCK_SHAPES), dtype=torch.float32)

    def at(distance: int):
        def run() -> None:
            lib.block_quant_set_prefetch(distance)
            for codes, scales, mins, n, k in weights:
                lib.block_quant_rows_bf16(inputs[k].data_ptr(), codes.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                                          y.data_ptr(), 1, n, k, 4)
        return run

    ratios, times = tuning._paired_times(0, {distance: at(distance) for distance in tuning.CANDIDATES})
    best = tuning._best_distance(ratios)
    lib.block_quant_set_prefetch(best)
    num_bytes = len(weights) // len(tuning.BLOCK_SHAPES) * layer_bytes
    return {"block_quant_prefetch": best,
            "block_gb_per_s": {str(d): round(num_bytes / t / 1e9, 2) for d, t in times.items()}}


def measure_block_panel_rows(lib) -> dict:
    """Times the block kernel's decoded panels (block_quant_rows_bf16 above its exact rows) against
    the weight dequantized to bfloat16 and torch's matmul, as a prefill multiplies kept blocks, on
    Q4_1 weights of SmolLM2's layer shapes at BLOCK_PANEL_ROWS rows (module doc)."""
    import torch

    from pagedserve.kernels.linear import block_quant

    if not lib.block_quant_rows_bf16_available():
        return {"block_quant_panel_rows": tuning.BLOCK_PANEL_MIN_ROWS, "block_panel_ratios": {}}
    generator = torch.Generator().manual_seed(0)
    weights = [block_quant.BlockQuantWeight.from_codes(
        torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator),
        (torch.rand(n, k // 32, generator=generator) * 0.01).to(torch.float16),
        (-torch.rand(n, k // 32, generator=generator) * 0.05).to(torch.float16), 4) for n, k in tuning.BLOCK_SHAPES]
    rows_kept, ratios = tuning.BLOCK_PANEL_MIN_ROWS, {}
    for rows in BLOCK_PANEL_ROWS:
        inputs = [torch.randn(rows, w.in_features, generator=generator).to(torch.bfloat16) for w in weights]
        outputs = [torch.empty(rows, w.out_features) for w in weights]

        def panels_pass() -> None:
            for x, w, y in zip(inputs, weights, outputs):
                lib.block_quant_rows_bf16(x.data_ptr(), w.qs.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr(),
                                          y.data_ptr(), rows, w.out_features, w.in_features, w.bits)
                y.to(torch.bfloat16)  # the rounding block_quant_linear_native does

        def dequantized_pass() -> None:  # block_quant_linear_dequant, through this library (not yet loaded)
            for x, w in zip(inputs, weights):
                dense = torch.empty(w.out_features, w.in_features, dtype=torch.bfloat16)
                lib.block_quant_dequantize(w.qs.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr(), dense.data_ptr(),
                                           w.out_features, w.in_features, w.bits, BF16_CODE)
                torch.nn.functional.linear(x, dense)

        by_path, _ = tuning._paired_times("dequantized", {"dequantized": dequantized_pass, "panels": panels_pass})
        ratios[str(rows)] = round(by_path["panels"], 3)
        if by_path["panels"] >= 1 + tuning.NOISE:
            break  # slower here: the dequantized copy from these rows on
        rows_kept = rows
    return {"block_quant_panel_rows": rows_kept, "block_panel_ratios": ratios}
