"""One rank's KV of one block in a file, and the checks that keep a bad file out of the cache.

    offset 0   MAGIC (8 bytes)  "PSKVBLK1"
           8   header length H (4 bytes, little endian)
          12   header: JSON {layout_id, layout, key, rank, payload_bytes, payload_blake2b}
        12+H   payload: for the target model, then the draft model (if any), every layer's
               K then V of the block, [block_size, num_kv_heads, head_size] raw bytes each

A file is written to a temporary name in the same folder, flushed, then renamed into place, so a
reader sees a whole file or none (a writer killed mid-write leaves a temporary file, which the
scheduler's scan removes later). A read returns the payload only when the magic, the header, the
layout id, the key, the rank, the length and the payload's BLAKE2b all match; otherwise it raises
BadBlockFile and the caller removes the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

MAGIC = b"PSKVBLK1"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 16


class BadBlockFile(ValueError):
    """Missing, truncated, corrupt, or of another layout, key or rank."""


def encode(payload: bytes, *, key: bytes, rank: int, layout_id: str, layout: dict) -> bytes:
    header = json.dumps({"layout_id": layout_id, "layout": layout, "key": key.hex(), "rank": rank,
                         "payload_bytes": len(payload),
                         "payload_blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()},
                        sort_keys=True).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


def decode(data: bytes, *, key: bytes, rank: int, layout_id: str, payload_bytes: int) -> bytes:
    """The payload of a block file's bytes, or BadBlockFile."""
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start or data[:len(MAGIC)] != MAGIC:
        raise BadBlockFile("not a block file (magic)")
    (header_bytes,) = _LENGTH.unpack_from(data, len(MAGIC))
    if header_bytes > MAX_HEADER_BYTES or len(data) < start + header_bytes:
        raise BadBlockFile("truncated header")
    try:
        header = json.loads(data[start:start + header_bytes])
    except ValueError as exc:
        raise BadBlockFile(f"corrupt header: {exc}") from None
    if not isinstance(header, dict):
        raise BadBlockFile("corrupt header")
    expected = {"layout_id": layout_id, "key": key.hex(), "rank": rank, "payload_bytes": payload_bytes}
    for name, value in expected.items():
        if header.get(name) != value:
            raise BadBlockFile(f"{name} is {header.get(name)!r}, expected {value!r}")
    payload = data[start + header_bytes:]
    if len(payload) != payload_bytes:
        raise BadBlockFile(f"payload of {len(payload)} bytes, expected {payload_bytes} (truncated)")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("payload_blake2b"):
        raise BadBlockFile("payload checksum mismatch (corrupt)")
    return payload


def write_atomically(path: str, data: bytes) -> None:
    """Writes data to path through a temporary file and a rename (fsync'd before the rename)."""
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise


def read(path: str, *, key: bytes, rank: int, layout_id: str, payload_bytes: int) -> bytes:
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_HEADER_BYTES + 12 + payload_bytes + 1)
    except OSError as exc:
        raise BadBlockFile(f"cannot read: {exc}") from None
    return decode(data, key=key, rank=rank, layout_id=layout_id, payload_bytes=payload_bytes)


def remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
