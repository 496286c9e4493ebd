"""Rotary position embedding (RoPE) with the scaling variants Llama-family configs ask for.

One table holds cos and sin for every position up to `max_positions`, computed once at start-up;
a forward gathers the rows of its tokens' positions, so prefill chunks and decodes of any length
mix freely in one flat batch. Rotation follows Hugging Face's "rotate half" convention (the first
and second halves of each head form the pairs):

    x = [x1 | x2]  ->  [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

Scaling variants (config `rope_parameters`, or the older `rope_scaling` + `rope_theta`):
  default   inv_freq = 1 / theta^(2i / d)
  linear    inv_freq / factor
  llama3    long wavelengths divided by factor, short ones kept, a smooth ramp between
  yarn      blend of interpolated and extrapolated frequencies, cos/sin scaled by attention_factor
  dynamic   NTK-aware: a position p beyond max_position_embeddings (M) uses
            theta' = theta * (factor * (p + 1) / M - (factor - 1))^(d / (d - 2)), positions below M
            the plain frequencies. Per position, so a token's rotation never depends on the batch;
            this equals Hugging Face's token-by-token decoding, whose prefill instead rescales the
            whole prompt by its longest length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedserve.kernels import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class RopeConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """What the rotary table needs from a checkpoint's config.json."""

    head_size: int
    theta: float = 10000.0
    rope_type: str = "default"
    max_position_embeddings: int = 2048
    params: dict = field(default_factory=dict)  # the scaling parameters as the config names them

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise RopeConfigError(
                f"RoPE type {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.head_size <= 0 or self.head_size % 2:
            raise RopeConfigError(f"head size must be a positive even number, not {self.head_size}")
        if self.theta <= 0:
            raise RopeConfigError(f"rope_theta must be positive, not {self.theta}")
        if self.rope_type in ("linear", "dynamic", "llama3") and "factor" not in self.params:
            raise RopeConfigError(f"RoPE type {self.rope_type!r} needs a 'factor'")
        if self.rope_type == "llama3":
            missing = {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} - set(self.params)
            if missing:
                raise RopeConfigError(f"llama3 RoPE scaling is missing {sorted(missing)}")
        if self.rope_type == "yarn" and "original_max_position_embeddings" not in self.params:
            raise RopeConfigError("yarn RoPE scaling needs 'original_max_position_embeddings'")
        partial = float(self.params.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise RopeConfigError(f"partial_rotary_factor {partial} is not supported (only 1.0)")

    @classmethod
    def from_hf_config(cls, config: dict, head_size: int) -> "RopeConfig":
        """Reads `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (older files)."""
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
        return cls(
            head_size=head_size,
            theta=float(theta),
            rope_type=str(rope_type),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            params=params,
        )


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:  # [dim // 2] float32
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(config: RopeConfig) -> torch.Tensor:  # [dim // 2]
    inv_freq = _base_inv_freq(config.theta, config.head_size)
    factor = float(config.params["factor"])
    low_freq_factor = float(config.params["low_freq_factor"])
    high_freq_factor = float(config.params["high_freq_factor"])
    old_context_len = float(config.params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(config: RopeConfig) -> tuple[torch.Tensor, float]:  # [dim // 2], attention factor
    params, dim, base = config.params, config.head_size, config.theta
    original_max = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or config.max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def _angles(config: RopeConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """Rotation angles for positions 0..max_positions-1: ([max_positions, dim // 2], cos/sin scale)."""
    positions = torch.arange(max_positions, dtype=torch.float32)  # [P]
    dim = config.head_size
    if config.rope_type == "dynamic":
        factor = float(config.params["factor"])
        limit = config.max_position_embeddings
        lengths = torch.clamp(positions + 1, min=limit)  # [P]
        bases = config.theta * ((factor * lengths / limit) - (factor - 1)) ** (dim / (dim - 2))  # [P]
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim // 2]
        inv_freq = 1.0 / (bases[:, None] ** exponents[None, :])  # [P, dim // 2]
        inv_freq[:limit] = _base_inv_freq(config.theta, dim)
        return positions[:, None] * inv_freq, 1.0
    scale = 1.0
    if config.rope_type == "default":
        inv_freq = _base_inv_freq(config.theta, dim)
    elif config.rope_type == "linear":
        inv_freq = _base_inv_freq(config.theta, dim) / float(config.params["factor"])
    elif config.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(config)
    else:
        inv_freq, scale = _yarn_inv_freq(config)
    return positions[:, None] * inv_freq[None, :], scale  # [P, dim // 2]


class RotaryEmbedding(torch.nn.Module):
    """cos/sin table for positions [0, max_positions), applied to flat query and key batches.

    The table holds each position's rotation at full head width, the sign of "rotate half" folded
    into sin, so a rotation is three elementwise ops and one cat, with the same roundings as the
    half-width form (x2 * (-sin) is -(x2 * sin) exactly):

        cos_full = [cos | cos]    sin_signed = [-sin | sin]
        rotate(x) = x * cos_full + [x2 | x1] * sin_signed
    """

    def __init__(self, config: RopeConfig, max_positions: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        if max_positions <= 0:
            raise RopeConfigError(f"max_positions must be positive, not {max_positions}")
        self.config = config
        self.max_positions = max_positions
        angles, scale = _angles(config, max_positions)  # [P, half]
        cos = (angles.cos() * scale).to(dtype)  # [P, half]
        sin = (angles.sin() * scale).to(dtype)  # [P, half]
        self.register_buffer("cos_sin", torch.cat([cos, cos, -sin, sin], dim=-1).to(device),
                             persistent=False)  # [P, 2 * head_size]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos_full, sin_signed), each [T, 1, head_size], broadcasting over heads."""
        rows = self.cos_sin.index_select(0, positions)  # [T, 2 * head_size]
        cos, sin = rows.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, head_size] each
        return cos, sin

    def step_rows(self, positions: torch.Tensor, step_plans: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """lookup(positions), once per step: kept in the step's plans (AttentionMetadata.step_plans)."""
        rows = step_plans.get(("rotary_rows", id(self)))
        if rows is None:
            rows = step_plans[("rotary_rows", id(self))] = self.lookup(positions)
        return rows

    def check_positions(self, positions: torch.Tensor, step_plans: dict) -> None:
        """IndexError (as lookup raises) when a position is outside the table; checked once per step,
        and not at all when whoever built the step already checked every position below a bound
        within the table (step_plans["positions_below"], worker/model_input.py)."""
        if ("rotary_checked", id(self)) not in step_plans:
            # a bound already checked spares two reductions on tensors that a decode step's weights
            # have just pushed out of the CPU caches (about 36 us a step)
            table = self.max_positions
            checked = step_plans.get("positions_below", table + 1) <= table
            if not checked and positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < table:
                raise IndexError(f"positions beyond the rotary table of {self.max_positions}")
            step_plans[("rotary_checked", id(self))] = True

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_size] (any heads: query and key heads side by side) -> rotated copy."""
        return ops.rotate(x, cos, sin)  # [T, heads, head_size]
