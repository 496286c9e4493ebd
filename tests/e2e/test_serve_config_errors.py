"""`pagedserve serve` with a configuration the model or the host cannot run ends at once with exit
code 2 and a message naming the problem, instead of restarting workers that cannot start:
refused before anything starts (heads that do not split across the ranks, memory the host does
not have), or a child that exits 2 (a configuration error) while starting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.launch.serve_config import free_port
from tests.e2e.conftest import build_checkpoint

CONFIG_ERROR_WITHIN_S = 60.0  # a worker's start (torch import) on a busy 2-core host, at most


def _serve(model: Path, *args: str, timeout: float = CONFIG_ERROR_WITHIN_S) -> tuple[int, str, float]:
    """serve's exit code, output and seconds until it exited."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(model), "--device", "cpu",
         "--port", str(free_port()), "--scheduler-port", str(free_port()), *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


@pytest.fixture(scope="module")
def nine_head_checkpoint(tmp_path_factory) -> Path:
    """A Llama with 9 attention heads (3 KV heads): it splits across 1, 3 or 9 ranks, not 2."""
    return build_checkpoint(tmp_path_factory.mktemp("nine-heads"), "llama", hidden_size=72, num_layers=1,
                            num_heads=9, num_kv_heads=3, intermediate_size=144, max_position_embeddings=256)


def test_heads_that_do_not_split_across_the_ranks_end_serve_before_it_starts(nine_head_checkpoint):
    code, output, seconds = _serve(nine_head_checkpoint, "--tensor-parallel-size", "2")
    assert code == 2, output
    assert "num_attention_heads (9) is not divisible by --tensor-parallel-size 2" in output
    assert "sizes that work for this model: 1, 3, 9" in output
    assert "child_started" not in output  # nothing was started
    assert seconds < 30


def test_memory_the_host_does_not_have_ends_serve_before_it_starts(llama_checkpoint):
    code, output, _ = _serve(llama_checkpoint, "--kv-cache-memory", "100000")
    assert code == 2, output
    assert "--kv-cache-memory does not fit this host" in output and "child_started" not in output


def test_a_child_exiting_2_while_starting_ends_serve_with_2(llama_checkpoint, tmp_path):
    """The checks serve makes cannot know every configuration error: a checkpoint folder without
    weights passes them (config.json and tokenizer are there), its worker exits 2 naming what is
    missing, and serve ends at once instead of restarting it."""
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    for path in llama_checkpoint.iterdir():
        if path.suffix != ".safetensors":
            (weightless / path.name).write_bytes(path.read_bytes())
    code, output, seconds = _serve(weightless)
    assert code == 2, output
    assert "no *.safetensors files" in output
    assert '"child": "worker-0", "exit_code": 2' in output and "configuration error" in output
    assert output.count('"child_started"') == 3  # scheduler, worker, frontend: no restart
    assert seconds < CONFIG_ERROR_WITHIN_S


def test_draft_flags_that_do_not_go_together_are_refused_before_anything_starts(llama_checkpoint):
    code, output, _ = _serve(llama_checkpoint, "--speculative-method", "draft")
    assert code == 2, output
    assert output.strip().splitlines() == [
        "pagedserve serve: speculative_model: --speculative-method draft needs --speculative-model PATH "
        "(the draft model)"]
    code, output, _ = _serve(llama_checkpoint, "--speculative-method", "ngram", "--speculative-model",
                             str(llama_checkpoint))
    assert code == 2, output
    assert output.strip().splitlines() == [
        "pagedserve serve: speculative_model: --speculative-model is for --speculative-method draft, not ngram"]
