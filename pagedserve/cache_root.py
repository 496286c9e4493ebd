"""The one folder pagedserve writes what it builds or fetches on first use: PAGEDSERVE_CACHE, by
default ~/.cache/pagedserve.

Beneath it, each producer names its own subfolder: the demo checkpoint (checkpoints/demo.py),
SmolLM2's GGUF (checkpoints/smollm2.py), files derived from a GGUF (checkpoints/gguf_cache.py),
the native kernel library (kernels/native/library.py), and what the benchmarks download or convert.
Nothing here imports torch, so every process may ask for it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PAGEDSERVE_CACHE"


def cache_dir() -> Path:
    """PAGEDSERVE_CACHE, or ~/.cache/pagedserve; read on every call (tests point it elsewhere)."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "pagedserve"))
