"""The built-in `demo` model: a small deterministic Llama checkpoint with its own tokenizer.

Built on first use into the cache folder (pagedserve.cache_root: PAGEDSERVE_CACHE, default
~/.cache/pagedserve), so a fresh offline machine can serve. The weights are seeded random: the text is not meaningful, but
every serving path (tokenizer, paged KV cache, sampling, streaming) runs as with a real model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pagedserve.cache_root import cache_dir

DEMO_NAME = "demo"
DEMO_VERSION = 1
DEMO_VOCAB_SIZE = 1024


def demo_path() -> Path:
    return cache_dir() / f"{DEMO_NAME}-v{DEMO_VERSION}"


def ensure_demo_model() -> Path:
    """Returns the demo checkpoint folder, building it first if it is not there yet."""
    target = demo_path()
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        build_demo_model(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_demo_model(folder: Path) -> Path:
    from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
    from pagedserve.checkpoints.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tokenizer

    build_tokenizer(folder, vocab_size=DEMO_VOCAB_SIZE)
    build_tiny_checkpoint(
        folder,
        architecture="llama",
        vocab_size=DEMO_VOCAB_SIZE,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=352,
        max_position_embeddings=4096,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        seed=0,
    )
    (folder / "pagedserve_demo.json").write_text(json.dumps({"version": DEMO_VERSION}))
    return folder
