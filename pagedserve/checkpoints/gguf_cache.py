"""Where files derived from a GGUF model live in the pagedserve cache (PAGEDSERVE_CACHE).

gguf.GGUFReader parses every tokenizer string of a header (seconds for a 49k vocabulary; the
processes read headers with pagedserve.checkpoints.gguf_header, which does not), and transformers'
conversion of its tokenizer takes longer; each process would pay that at every start. What they
derive is therefore kept once per version of the file:

    <cache>/gguf/<file stem>-<key>/config-v1.json          the GGUFConfig (pagedserve.checkpoints.gguf_config)
    <cache>/gguf/<file stem>-<key>/tokenizer-<version>/     the converted tokenizer folder

The key hashes the file's resolved path, size and modification time, so a replaced or modified
file gets a new folder. Writes go to a temporary name first and are renamed into place, so a
reader never sees half a file; a cache that cannot be written is skipped, not fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

GGUF_CACHE = "gguf"


def derived_folder(gguf_file: Path) -> Path:
    from pagedserve.cache_root import cache_dir

    stat = gguf_file.stat()
    identity = f"{gguf_file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir() / GGUF_CACHE / f"{gguf_file.stem}-{key}"


def read_json(path: Path) -> dict | None:
    """The JSON object at path, or None when it is missing or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: dict) -> bool:
    """Writes value atomically; False when the cache cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        with os.fdopen(handle, "w") as out:
            json.dump(value, out)
        os.replace(staging, path)
    except OSError:
        return False
    return True
