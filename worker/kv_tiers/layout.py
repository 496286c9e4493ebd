"""What makes one rank's KV block reusable by another process: the model's content, the dtypes,
the fp8 scales, the geometry and the tensor-parallel layout. Its digest, the layout id, names the
folder of the block files (pagedserve.contracts.tier_ops.layout_dir), so a replica of another
model, dtype, block size or layout never even lists them; every block file's header repeats it
and a read checks it.

The model digest is BLAKE2b over the checkpoint's files (config.json, weights, a GGUF file),
remembered in the pagedserve cache folder by (path, size, modification time) so a large
checkpoint is hashed once per change, not once per start.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.checkpoints.demo import cache_dir

FORMAT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class KvLayout:
    model_digest: str
    dtype: str  # the model's compute dtype
    kv_cache_dtype: str
    kv_scales: str  # digest of every attention layer's (k_scale, v_scale)
    block_size: int
    num_layers: int
    num_kv_heads: int  # on this rank
    head_size: int
    world_size: int
    quantization: str
    draft: str = ""  # the draft model's digest and geometry, when its KV shares the blocks
    version: int = FORMAT_VERSION

    @property
    def layout_id(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def describe(self) -> dict:
        return asdict(self)


def checkpoint_files(model_path: str | os.PathLike) -> list[Path]:
    path = Path(model_path)
    if path.is_file():
        return [path]
    return sorted(file for file in path.iterdir()
                  if file.is_file() and (file.name == "config.json" or file.suffix in _WEIGHT_SUFFIXES))


def model_digest(model_path: str | os.PathLike) -> str:
    """BLAKE2b over the checkpoint's files (names and content), memoised by (path, size, mtime)."""
    files = checkpoint_files(model_path)
    identity = hashlib.blake2b(digest_size=16)
    for file in files:
        stat = file.stat()
        identity.update(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    memo = cache_dir() / "model-digests" / identity.hexdigest()
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    value = digest.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        temporary = memo.with_suffix(f".tmp{os.getpid()}")
        temporary.write_text(value)
        os.replace(temporary, memo)
    except OSError:
        pass
    return value


def scales_digest(model) -> str:
    """Digest of every attention layer's fp8 read scales (all 1.0 unless a checkpoint sets them)."""
    scales = [(float(module.k_scale), float(module.v_scale)) for module in model.modules()
              if hasattr(module, "k_scale") and hasattr(module, "v_scale")]
    return hashlib.blake2b(json.dumps(scales).encode(), digest_size=8).hexdigest()
