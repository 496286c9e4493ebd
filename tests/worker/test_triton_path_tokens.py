"""The worker's forward gives the same greedy tokens whether the plain-torch reference or the
Triton kernels (run by the Triton interpreter on CPU) compute paged attention and KV writes.

On a machine with CUDA, the compiled kernels on the GPU give the CPU reference's tokens too.

Triton decides on interpretation once per process, when triton is first imported, so each path
runs in its own child process with its own environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint

CHILD = Path(__file__).with_name("triton_path_child.py")


def _generate(checkpoint: Path, device: str = "cpu", **env: str) -> list[list[int]]:
    result = subprocess.run([sys.executable, str(CHILD), str(checkpoint), device], capture_output=True,
                            text=True, timeout=600, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _checkpoint(tmp_path: Path) -> Path:
    return build_tiny_checkpoint(tmp_path / "llama", architecture="llama", hidden_size=64, num_layers=2,
                                 num_heads=4, num_kv_heads=2, intermediate_size=128, seed=3)


def test_reference_and_interpreted_triton_give_the_same_tokens(tmp_path):
    checkpoint = _checkpoint(tmp_path)
    reference = _generate(checkpoint, PAGEDSERVE_KERNELS="reference")
    triton = _generate(checkpoint, PAGEDSERVE_KERNELS="triton", TRITON_INTERPRET="1")
    assert all(len(tokens) == 6 for tokens in reference)
    assert triton == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA device")
def test_cuda_worker_gives_the_cpu_reference_tokens(tmp_path):
    checkpoint = _checkpoint(tmp_path)
    reference = _generate(checkpoint, PAGEDSERVE_KERNELS="reference")
    cuda = _generate(checkpoint, "cuda", PAGEDSERVE_KERNELS="triton")
    assert all(len(tokens) == 6 for tokens in reference)
    assert cuda == reference
