"""build_model_input: the list-built tensors of one-token decode steps equal the numpy path's, and
plans that break a rule raise the same PlanError either way."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq
from pagedserve.worker import model_input
from pagedserve.worker.model_input import PlanError, build_model_input

FIELDS = ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices")
KW = dict(block_size=16, num_blocks=200, max_positions=1000, device=torch.device("cpu"))


def _numpy_path(seqs, monkeypatch, **kw):
    with monkeypatch.context() as patch:
        patch.setattr(model_input, "DECODE_LIST_SEQS", 0)
        return build_model_input(seqs, **{**KW, **kw})


def _random_decodes(rng: random.Random, num_seqs: int) -> list[ScheduledSeq]:
    seqs = []
    for seq_id in range(num_seqs):
        position = rng.randrange(0, 400)
        table = [rng.randrange(0, 200) for _ in range(position // 16 + 1 + rng.randrange(0, 3))]
        sample = SampleSpec(temperature=rng.choice([0.0, 0.7])) if rng.random() < 0.8 else None
        seqs.append(ScheduledSeq(seq_id * 3 + 1, [rng.randrange(0, 50000)], position, table, sample))
    return seqs


@pytest.mark.parametrize("num_seqs", [1, 2, 5, 64])
def test_decode_steps_from_lists_equal_the_numpy_path(num_seqs, monkeypatch):
    rng = random.Random(num_seqs)
    for _ in range(20):
        seqs = _random_decodes(rng, num_seqs)
        if all(seq.sample is None for seq in seqs):
            continue
        built, expected = build_model_input(seqs, **KW), _numpy_path(seqs, monkeypatch)
        for name in FIELDS:
            a, b = getattr(built.metadata, name), getattr(expected.metadata, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert torch.equal(built.token_ids, expected.token_ids) and built.token_ids.dtype == expected.token_ids.dtype
        assert (built.sample_seq_ids, built.sample_specs, built.sample_positions, built.sample_draft_ids) == (
            expected.sample_seq_ids, expected.sample_specs, expected.sample_positions, expected.sample_draft_ids)
        assert (built.mask_row_indices, built.token_bitmasks) == (expected.mask_row_indices, expected.token_bitmasks)


def test_a_decode_step_records_the_bound_it_checked_its_positions_against(monkeypatch):
    """Every position of a decode step built from lists is checked below max_positions, which the
    step's plans record so that the rotary table does not check them again; the numpy path records
    nothing."""
    seqs = _random_decodes(random.Random(7), 3)
    assert build_model_input(seqs, **KW).metadata.step_plans == {"positions_below": KW["max_positions"]}
    assert _numpy_path(seqs, monkeypatch).metadata.step_plans == {}


@pytest.mark.parametrize(("position", "table", "kw"), [
    (1000, list(range(63)), {}),  # beyond max_positions
    (40, [1, 2], {}),  # the blocks cannot hold position 40
    (5, [200], {}),  # a block id beyond the pool
    (5, [-1], {}),
    (-1, [3], {}),
])
def test_a_bad_decode_raises_what_the_numpy_path_raises(position, table, kw, monkeypatch):
    seqs = [ScheduledSeq(1, [7], 3, [4], SampleSpec()), ScheduledSeq(2, [9], position, table, SampleSpec())]
    with pytest.raises(PlanError) as expected:
        _numpy_path(seqs, monkeypatch, **kw)
    with pytest.raises(PlanError) as raised:
        build_model_input(seqs, **KW, **kw)
    assert raised.value.args == expected.value.args
