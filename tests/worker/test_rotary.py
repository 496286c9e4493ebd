"""Our RoPE tables against transformers' rotary embedding for each supported scaling type."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedserve.worker.layers.rotary import RopeConfig, RopeConfigError, RotaryEmbedding

HEAD_SIZE = 32
MAX_POSITIONS = 256

SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def _hf_config(scaling: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_SIZE * 2, num_attention_heads=2, num_hidden_layers=1, vocab_size=16,
                       max_position_embeddings=64, rope_parameters={"rope_theta": 50000.0, **scaling})


def _ours(scaling: dict) -> RotaryEmbedding:
    config = RopeConfig.from_hf_config(_hf_config(scaling).to_dict(), HEAD_SIZE)
    return RotaryEmbedding(config, MAX_POSITIONS, dtype=torch.float32, device="cpu")


def _hf_cos_sin(scaling: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = LlamaRotaryEmbedding(_hf_config(scaling))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, T, hs]
    return cos[0], sin[0]


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "dynamic"])
def test_rotation_matches_transformers_within_original_context(name):
    positions = torch.arange(64)
    ours = _ours(SCALINGS[name])
    cos, sin = ours.lookup(positions)  # [T, 1, hs]: cos at full width, sin with rotate-half's sign
    hf_cos, hf_sin = _hf_cos_sin(SCALINGS[name], positions)  # [T, hs]
    sign = torch.cat([-torch.ones(HEAD_SIZE // 2), torch.ones(HEAD_SIZE // 2)])  # [hs]
    assert torch.allclose(cos[:, 0], hf_cos, atol=1e-6)
    assert torch.allclose(sin[:, 0] * sign, hf_sin, atol=1e-6)
    query = torch.randn(64, 3, HEAD_SIZE, generator=torch.Generator().manual_seed(0))  # [T, heads, hs]
    as_hf = query.transpose(0, 1)[None]  # [1, heads, T, hs]
    expected, _ = apply_rotary_pos_emb(as_hf, as_hf, hf_cos[None], hf_sin[None])
    assert torch.allclose(RotaryEmbedding.rotate(query, cos, sin), expected[0].transpose(0, 1), atol=1e-5)


def test_dynamic_scaling_beyond_the_original_context_matches_token_by_token_decoding():
    ours = _ours(SCALINGS["dynamic"])
    for position in (64, 100, 255):
        cos, _ = ours.lookup(torch.tensor([position]))
        hf_cos, _ = _hf_cos_sin(SCALINGS["dynamic"], torch.tensor([position]))
        assert torch.allclose(cos[:, 0], hf_cos, atol=1e-5), position
    plain_cos, _ = _ours(SCALINGS["default"]).lookup(torch.tensor([100]))
    assert not torch.allclose(ours.lookup(torch.tensor([100]))[0], plain_cos)


def test_unsupported_scaling_is_rejected():
    with pytest.raises(RopeConfigError, match="longrope"):
        RopeConfig(head_size=HEAD_SIZE, rope_type="longrope", params={"factor": 2.0})
    with pytest.raises(RopeConfigError, match="factor"):
        RopeConfig(head_size=HEAD_SIZE, rope_type="linear")
    with pytest.raises(RopeConfigError, match="low_freq_factor"):
        RopeConfig(head_size=HEAD_SIZE, rope_type="llama3", params={"factor": 8.0})


def test_positions_are_checked_once_unless_the_step_checked_a_bound_within_the_table():
    ours = _ours(SCALINGS["default"])
    beyond = torch.tensor([3, MAX_POSITIONS])
    with pytest.raises(IndexError, match="beyond the rotary table"):
        ours.check_positions(beyond, {})
    with pytest.raises(IndexError):  # a bound past the table checks nothing for it
        ours.check_positions(beyond, {"positions_below": MAX_POSITIONS + 1})
    plans = {"positions_below": MAX_POSITIONS}  # what build_model_input records for a decode step
    ours.check_positions(beyond, plans)  # trusted: no reduction over the positions
    assert plans[("rotary_checked", id(ours))] is True
    checked = {}
    ours.check_positions(torch.tensor([0, MAX_POSITIONS - 1]), checked)
    ours.check_positions(beyond, checked)  # once per step: the step's plans say it was checked
