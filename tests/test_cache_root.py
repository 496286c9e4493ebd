"""Every producer of cached files resolves the one root, pagedserve.cache_root.cache_dir()."""

from __future__ import annotations

from pathlib import Path

from pagedserve.cache_root import CACHE_ENV, cache_dir
from pagedserve.checkpoints.demo import demo_path
from pagedserve.checkpoints.gguf_cache import derived_folder
from pagedserve.checkpoints.smollm2 import smollm2_path
from pagedserve.kernels.native import library as native_lib


def test_the_root_follows_the_environment_on_every_call(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert cache_dir() == Path.home() / ".cache" / "pagedserve"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_every_cached_file_lies_under_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    paths = [demo_path(), smollm2_path(), derived_folder(gguf)]
    compiler = native_lib.compiler()
    if compiler is not None:
        paths.append(native_lib.library_path(compiler))
    for path in paths:
        assert path.is_relative_to(tmp_path / "cache"), path
