"""How `serve` divides the host's CPU cores between the processes it starts."""

from __future__ import annotations

import pytest

from pagedserve.launch import serve_config
from pagedserve.cli import build_parser
from pagedserve.launch.serve_config import ServeConfig, threads_per_rank


@pytest.mark.parametrize("num_cores, num_ranks, expected", [
    (1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 1, 4), (4, 2, 2), (4, 8, 1), (16, 1, 16), (16, 2, 8), (16, 4, 4)])
def test_threads_per_rank_splits_the_cores_between_the_ranks(monkeypatch, num_cores, num_ranks, expected):
    monkeypatch.setattr(serve_config.os, "sched_getaffinity", lambda pid: set(range(num_cores)))
    assert threads_per_rank(num_ranks) == expected


def _worker_args(tmp_path, monkeypatch, *extra: str) -> list[list[str]]:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(serve_config.os, "sched_getaffinity", lambda pid: set(range(4)))
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), *extra])
    return ServeConfig.from_args(args).worker_args


def test_every_worker_gets_its_share_of_threads(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for workers, expected in ((_worker_args(tmp_path, monkeypatch), "4"),
                              (_worker_args(tmp_path, monkeypatch, "--tensor-parallel-size", "2"), "2")):
        for worker in workers:
            assert worker[worker.index("--num-threads") + 1] == expected


def test_an_operator_set_omp_num_threads_is_left_to_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    (worker,) = _worker_args(tmp_path, monkeypatch)
    assert "--num-threads" not in worker
