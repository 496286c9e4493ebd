"""bench/lib/guidellm_client.py: where guidellm is found, the command line of one point (offline, the
same seed and data for every server) and the figures read back from guidellm's JSON report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def client():
    spec = importlib.util.spec_from_file_location("guidellm_client", ROOT / "bench" / "lib" / "guidellm_client.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_guidellm_is_found_in_its_own_venv_or_through_the_variable(client, monkeypatch, tmp_path):
    monkeypatch.delenv("GUIDELLM", raising=False)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert client.default_guidellm() == tmp_path / "guidellm-venv" / "bin" / "guidellm"
    assert f"python3 -m venv {tmp_path / 'guidellm-venv'}" in client.install_hint()
    monkeypatch.setenv("GUIDELLM", "/opt/guidellm")
    assert client.default_guidellm() == Path("/opt/guidellm")


def test_shapes_and_budgets_are_checked(client):
    assert client.Shape.parse("256x64") == client.Shape(256, 64)
    assert str(client.Shape(128, 16)) == "128x16"
    for text in ("256", "256x", "0x64", "ax64"):
        with pytest.raises(ValueError):
            client.Shape.parse(text)
    assert client.Budget(seconds=60).constraint() == "kind=max_duration,seconds=60"
    assert client.Budget(num_requests=8).constraint() == "kind=max_requests,count=8"
    for kwargs in ({}, {"seconds": 1, "num_requests": 1}, {"seconds": 0}):
        with pytest.raises(ValueError):
            client.Budget(**kwargs)


def test_a_point_runs_offline_on_the_local_tokenizer_with_its_seed(client, tmp_path):
    point = client.Point(client.Shape(256, 64), concurrency=8, seed=3)
    command = client.point_command(Path("/venv/bin/guidellm"), point, target="http://127.0.0.1:9", model="smollm2",
                                   tokenizer=tmp_path / "tok", budget=client.Budget(seconds=30),
                                   output=tmp_path / "out.json", warmup_fraction=0.1, body={"temperature": 0.0})
    options = dict(zip(command[2::2], command[3::2]))
    assert command[:2] == ["/venv/bin/guidellm", "run"] and command[-1] == "--disable-console"
    assert options["--backend"] == ("kind=openai_http,target=http://127.0.0.1:9,model=smollm2,"
                                    "request_format=/v1/chat/completions,stream=true,extras.body.temperature=0.0")
    assert options["--profile"] == "kind=concurrent,streams=8,warmup.percent=0.1,cooldown.percent=0.1"
    assert options["--data"] == "kind=synthetic_text,prompt_tokens=256,output_tokens=64"
    assert options["--tokenizer"] == f"kind=huggingface_auto,model={tmp_path / 'tok'},load_kwargs.local_files_only=true"
    assert options["--seed"] == "kind=static,value=3"
    assert options["--constraint"] == "kind=max_duration,seconds=30"


def _summary(mean: float, p50: float, p99: float, count: int = 4) -> dict:
    return {"mean": mean, "min": p50, "max": p99, "count": count, "percentiles": {"p50": p50, "p99": p99}}


def test_figures_come_from_guidellm_statistics(client):
    metrics = {
        "request_totals": {"successful": 4, "errored": 1, "incomplete": 2, "total": 7},
        "output_tokens_per_second": {"successful": _summary(90.0, 0, 0), "total": _summary(100.0, 0, 0)},
        "requests_per_second": {"successful": _summary(1.5, 0, 0)},
        "time_to_first_token_ms": {"successful": _summary(0, 120.0, 300.0)},
        "inter_token_latency_ms": {"successful": _summary(0, 20.0, 45.0)},
        "output_token_count": {"successful": _summary(64.0, 64.0, 64.0)},
    }
    report = {"benchmarks": [{"metrics": metrics, "duration": 30.5, "warnings": [{"note": "late"}],
                              "requests": {"errored": [{"info": {"error": "HTTPStatusError('400 Bad Request')"}}]}}]}
    figures = client.read_figures(report)
    assert (figures.output_tokens_per_second, figures.requests_per_second) == (100.0, 1.5)  # every request's tokens
    assert (figures.ttft_p50_ms, figures.ttft_p99_ms, figures.itl_p50_ms, figures.itl_p99_ms) == (120.0, 300.0, 20.0, 45.0)
    assert (figures.num_completed, figures.num_incomplete, figures.num_errored) == (4, 2, 1)
    assert (figures.output_tokens_min, figures.output_tokens_max) == (64.0, 64.0)
    assert figures.first_error == "HTTPStatusError('400 Bad Request')"
    assert figures.warnings == ["late"]
