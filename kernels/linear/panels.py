"""bfloat16 linear layers on the CPU with the weight repacked once, at load, into panels of 16
output columns (kernels/native/panel_linear.c multiplies them); reference F.linear on the weight
unpacked.

    panels = pack(weight)                      # PanelWeight, beside the dense weight
    y = panel_linear(x, panels, bias, lib)     # x [M, K] -> [M, N], any M
    y = panel_linear_ref(x, panels, bias)      # F.linear(x, unpack(panels), bias)

Layout: panel j holds the output columns 16 j .. 16 j + 15 (the columns past N zero) as [K / 2, 16, 2]:
for each pair of inputs p, the 16 columns' two weights side by side, one 64-byte vector, the
operand of one AVX-512 BF16 dot product against a pair of x's inputs broadcast, so each of the 16
lanes sums its own output column and the kernel reads the weight once per block of 8 rows of x
with no horizontal sums. The kernel multiplies BLOCK_PANELS panels at once, so the panels are
stored in blocks of that many (the last one may have fewer, P), their vectors interleaved pair by
pair: weight[16 j + c, 2 p + e] is element ((p P + j % 3) 16 + c) 2 + e of block j // 3, the blocks
one after another. A block's weights are then read in address order, as one stream (the kernel's
comment has the blocking and the measurements). K must be even.

Which bfloat16 layout a host's layers take, this one or oneDNN's (linear/onednn.py), is measured
once per host (kernels/native/tuning.py, `linear_bf16_layout`): on AMD Zen 4 (AVX-512 BF16 without
AMX) these panels ran SmolLM2's 121 projections 1.3-1.6x faster than oneDNN's prepacked weights
at 1 to 16 rows, 1.07x at 32 and 64 and about even at 128 and 512 (bench/panel_linear.py;
docs/kernels.md); where oneDNN has AMX tiles the measurement decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from pagedserve.kernels.native import library as native_lib

PANEL = 16
BLOCK_PANELS = 3  # panel_linear.c's WIDTH: the panels one register block multiplies at once


@dataclass(frozen=True)
class PanelWeight:
    """A weight [out_features, in_features] in panels (module doc)."""

    data: torch.Tensor  # [ceil(out / 16) * 16 * in] bfloat16, contiguous: the module doc's layout
    out_features: int
    in_features: int


def can_pack(weight: torch.Tensor) -> bool:
    """A bfloat16 CPU weight [out, in] with an even number of inputs."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and weight.shape[0] > 0)


def pack(weight: torch.Tensor) -> PanelWeight:
    """weight [N, K] (can_pack) -> its panels."""
    out_features, in_features = weight.shape
    num_panels, pairs = -(-out_features // PANEL), in_features // 2
    padded = weight.detach()
    if num_panels * PANEL != out_features:
        padded = torch.cat([padded, padded.new_zeros(num_panels * PANEL - out_features, in_features)])
    by_panel = padded.reshape(num_panels, PANEL, pairs, 2).permute(0, 2, 1, 3)  # [j, p, c, e]
    full = num_panels // BLOCK_PANELS * BLOCK_PANELS
    parts = [by_panel[:full].reshape(full // BLOCK_PANELS, BLOCK_PANELS, pairs, PANEL, 2).transpose(1, 2).reshape(-1)]
    if full < num_panels:
        parts.append(by_panel[full:].transpose(0, 1).reshape(-1))
    return PanelWeight(torch.cat(parts), out_features, in_features)


def unpack(panels: PanelWeight) -> torch.Tensor:
    """The dense weight [N, K] the panels were packed from."""
    num_panels, pairs = -(-panels.out_features // PANEL), panels.in_features // 2
    full = num_panels // BLOCK_PANELS * BLOCK_PANELS
    flat = panels.data.reshape(-1)
    blocks = flat[:full * pairs * PANEL * 2].reshape(full // BLOCK_PANELS, pairs, BLOCK_PANELS, PANEL, 2)
    by_panel = [blocks.transpose(1, 2).reshape(full, pairs, PANEL, 2)]
    if full < num_panels:
        by_panel.append(flat[full * pairs * PANEL * 2:].reshape(pairs, num_panels - full, PANEL, 2).transpose(0, 1))
    dense = torch.cat(by_panel).permute(0, 2, 1, 3).reshape(num_panels * PANEL, panels.in_features)
    return dense[:panels.out_features].contiguous()


def library():
    """The native library where it has the panel kernel (AVX-512 BF16), else None."""
    lib = native_lib.load()
    return lib if lib is not None and native_lib.has_kernel(lib, "panel_linear") else None


def panel_linear(x: torch.Tensor, panels: PanelWeight, bias: torch.Tensor | None, lib=None) -> torch.Tensor:
    """x [..., K] bfloat16 on the CPU @ the panels' weight^T + bias [N] -> [..., N] (bfloat16)."""
    lib = lib or library()
    if lib is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return panel_linear_ref(x, panels, bias)
    leading = x.shape[:-1]
    rows = x.reshape(-1, panels.in_features).contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty(rows.shape[0], panels.out_features, dtype=torch.bfloat16)
    if rows.shape[0]:
        lib.panel_linear_bf16(rows.data_ptr(), panels.data.data_ptr(), bias.data_ptr() if bias is not None else None,
                              y.data_ptr(), rows.shape[0], panels.out_features, panels.in_features)
    return y.reshape(*leading, panels.out_features)


def bound_panel_linear(x: torch.Tensor, panels: PanelWeight, bias: torch.Tensor | None, out: torch.Tensor, lib):
    """panel_linear(x, panels, bias) written into out [M, N] (bfloat16, contiguous) as a call without
    arguments, bound to these tensors (x [M, K] bfloat16, contiguous; the caller keeps all of them
    alive and changes only their values): the same kernel call, at none of the per-call checks."""
    return partial(lib.panel_linear_bf16, x.data_ptr(), panels.data.data_ptr(),
                   bias.data_ptr() if bias is not None else None, out.data_ptr(), x.shape[0], panels.out_features,
                   panels.in_features)


def panel_linear_ref(x: torch.Tensor, panels: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, unpack(panels), bias)
