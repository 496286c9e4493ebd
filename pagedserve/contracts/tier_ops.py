"""What a step asks of the KV tiers (host memory, block files on disk) beside its block operations,
and how block files are named (no torch: the scheduler lists the directory, the workers write it).

    device pool ──save──▶ host slot ──(writer thread)──▶ DIR/<layout id>/<key>.r<rank>.kvb
         ▲                   │  ▲                                   │
         └──────load─────────┘  └───────────fetch───────────────────┘

The worker runs them with the step's block operations in this order: saves (a device block
is read before a swap-in, a load or a copy of the same step may overwrite it), swap out,
fetches, swap in, loads, copy; deletes follow the saves through the disk writer's queue. A fetch
is confirmed by the step's result (StepResult.failed_fetch_keys names the ones that failed) before
the scheduler loads its slot into the device pool, so a bad file never reaches a forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

BLOCK_FILE_SUFFIX = ".kvb"
KEY_BYTES = 16


@dataclass(slots=True)
class TierSave:
    block_id: int  # device block holding the KV
    host_slot: int  # -1: not kept in host memory
    key: bytes
    to_disk: bool = False


@dataclass(slots=True)
class TierOps:
    saves: list[TierSave] = field(default_factory=list)
    fetches: list[tuple[bytes, int]] = field(default_factory=list)  # (key, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    deletes: list[bytes] = field(default_factory=list)  # keys whose block files go

    @property
    def is_empty(self) -> bool:
        return not (self.saves or self.fetches or self.loads or self.deletes)


def layout_dir(cache_dir: str | os.PathLike, layout_id: str) -> str:
    """The folder of one KV layout's block files: another model or layout never shares it."""
    return os.path.join(os.fspath(cache_dir), layout_id)


def block_file_name(key: bytes, rank: int) -> str:
    return f"{key.hex()}.r{rank}{BLOCK_FILE_SUFFIX}"


def parse_block_file_name(name: str) -> tuple[bytes, int] | None:
    """(key, rank) of a block file's name; None for anything else (temporary files included)."""
    if not name.endswith(BLOCK_FILE_SUFFIX):
        return None
    stem = name[:-len(BLOCK_FILE_SUFFIX)]
    key_hex, dot, rank = stem.partition(".r")
    if not dot or len(key_hex) != 2 * KEY_BYTES or not rank.isdigit():
        return None
    try:
        return bytes.fromhex(key_hex), int(rank)
    except ValueError:
        return None
