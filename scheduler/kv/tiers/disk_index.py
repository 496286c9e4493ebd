"""Which prefix keys have block files in this layout's folder, least-recently-used first, within
the disk budget; rebuilt from the folder at start.

A key counts as on disk when every tensor-parallel rank's file is there. The index is what this
replica wrote or found: another replica sharing the folder may remove a file behind its back, and
a writer may have died before renaming its file into place; a fetch of such a key fails and the
key is dropped (kv_tiers.py), so the index may be optimistic but never serves a bad block.
Temporary files of writers that died (older than STALE_TEMP_SECONDS) are removed at the scan.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict

from pagedserve.contracts.tier_ops import parse_block_file_name

STALE_TEMP_SECONDS = 600.0


class DiskIndex:
    def __init__(self, max_num_blocks: int) -> None:
        if max_num_blocks < 0:
            raise ValueError(f"max_num_blocks must be >= 0, not {max_num_blocks}")
        self.max_num_blocks = max_num_blocks
        self._keys: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.num_evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[bytes]:
        return list(self._keys)

    def touch(self, key: bytes) -> None:
        self._keys.move_to_end(key)

    def add(self, key: bytes) -> list[bytes]:
        """Records key as written (most recent); returns the keys evicted to stay in budget."""
        if self.max_num_blocks == 0:
            return []
        self._keys[key] = None
        self._keys.move_to_end(key)
        evicted = []
        while len(self._keys) > self.max_num_blocks:
            old, _ = self._keys.popitem(last=False)
            evicted.append(old)
        self.num_evictions += len(evicted)
        return evicted

    def drop(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def load(self, folder: str, world_size: int, now: float | None = None) -> list[bytes]:
        """Fills the index from folder (keys with a file for every rank, oldest modification
        first); returns the keys beyond the budget, the oldest, for the workers to delete."""
        now = time.time() if now is None else now
        newest: dict[bytes, float] = {}
        ranks: dict[bytes, set[int]] = {}
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return []
        for entry in entries:
            parsed = parse_block_file_name(entry.name)
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if parsed is None:
                if ".tmp" in entry.name and now - stat.st_mtime > STALE_TEMP_SECONDS:
                    _remove(entry.path)
                continue
            key, rank = parsed
            if rank >= world_size or stat.st_size == 0:
                continue
            ranks.setdefault(key, set()).add(rank)
            newest[key] = max(newest.get(key, 0.0), stat.st_mtime)
        complete = [key for key, found in ranks.items() if len(found) == world_size]
        complete.sort(key=lambda key: newest[key])
        evicted = []
        for key in complete:
            evicted += self.add(key)
        return evicted


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
