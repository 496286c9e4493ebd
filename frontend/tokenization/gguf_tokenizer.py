"""The tokenizer of a GGUF model: converted by transformers from the file's metadata, then cached.

transformers builds a fast tokenizer (vocabulary, merges, special tokens, chat template) from a
GGUF file's `tokenizer.*` keys; that parses the whole header and takes seconds. The result is saved
once as an ordinary tokenizer folder beside the file's other derived data (pagedserve.checkpoints.gguf_cache),
one per transformers version, and loaded from there on every later start (with the `tokenizers`
library alone, plain_tokenizer.py). When the cache cannot be
written the converted tokenizer is used anyway (and converted again next time).
"""

from __future__ import annotations

import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

from pagedserve.checkpoints.gguf_cache import derived_folder
from pagedserve.checkpoints.gguf_config import GGUFFormatError, find_gguf_file
from pagedserve.frontend.tokenization.plain_tokenizer import load_plain_tokenizer
from pagedserve.log import get_logger

_COMPLETE_MARKER = "tokenizer_config.json"

log = get_logger(component="gguf_tokenizer")


def tokenizer_cache_path(gguf_file: Path) -> Path:
    return derived_folder(gguf_file) / f"tokenizer-{version('transformers')}"


def load_gguf_tokenizer(path: str | Path):
    """A tokenizer for the GGUF model at `path` (a .gguf file or a folder holding one): the cached
    folder's, read with the `tokenizers` library where it can be (plain_tokenizer.py), else with
    transformers."""
    gguf_file = find_gguf_file(path)
    if gguf_file is None:
        raise GGUFFormatError(f"{path} is neither a .gguf file nor a folder holding one")
    cached = tokenizer_cache_path(gguf_file)
    if (cached / _COMPLETE_MARKER).is_file():
        plain, why_not_plain = load_plain_tokenizer(cached)
        if plain is not None:
            return plain
        log.info("tokenizer_through_transformers", path=str(cached), reason=why_not_plain)
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        except (OSError, ValueError) as exc:
            log.warning("gguf_tokenizer_cache_unreadable", path=str(cached), error=str(exc))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True)
    _save(tokenizer, cached)
    return tokenizer


def _save(tokenizer, target: Path) -> None:
    """Writes the tokenizer folder under a temporary name, then renames it into place."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    except OSError as exc:
        log.warning("gguf_tokenizer_not_cached", path=str(target), error=str(exc))
        return
    try:
        tokenizer.save_pretrained(str(staging))
        shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier attempt
        staging.rename(target)
    except OSError as exc:  # another process finished first, or the disk is full
        if not (target / _COMPLETE_MARKER).is_file():
            log.warning("gguf_tokenizer_not_cached", path=str(target), error=str(exc))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
