"""The key of a full KV block for prefix caching, shared by the scheduler's prefix cache (which
finds cached blocks by it) and the frontend's replica router (which guesses, by the same keys,
which replica's cache holds a prompt's leading blocks).

    tokens  [ b0: t0 .. t15 ][ b1: t16 .. t31 ][ b2: partial ]
    keys      k0 = H(-, b0)    k1 = H(k0, b1)    (none: not full)

H is BLAKE2b (16 bytes) over the parent key and the block's token ids (int64, native order):
equal keys mean equal prefixes, and keys are stable across processes.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

_ROOT_KEY = b"pagedserve-prefix"


def hash_block(parent_key: bytes | None, token_ids: list[int]) -> bytes:
    """Key of a full block given the key of the block before it (None for the first)."""
    digest = blake2b(parent_key if parent_key is not None else _ROOT_KEY, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def adapter_root_key(digest: str) -> bytes:
    """The parent key of the first block of a sequence run with the LoRA adapter of this content
    digest: its KV never matches the base model's or another adapter's (or another version's)."""
    return blake2b(b"pagedserve-lora:" + digest.encode(), digest_size=16).digest()


def full_block_keys(token_ids: list[int], block_size: int, max_num_blocks: int | None = None) -> list[bytes]:
    """Keys of the full blocks of token_ids, first to last (at most max_num_blocks)."""
    num_blocks = len(token_ids) // block_size
    if max_num_blocks is not None:
        num_blocks = min(num_blocks, max_num_blocks)
    keys: list[bytes] = []
    for index in range(num_blocks):
        keys.append(hash_block(keys[-1] if keys else None, token_ids[index * block_size:(index + 1) * block_size]))
    return keys
