"""The KV tiers behind the device pool, as the scheduler sees them: which prefix keys the workers
keep in host memory (host_index.py) and in block files (disk_index.py), and the operations a step
sends them (pagedserve.contracts.tier_ops).

    device pool ──evicted──▶ host tier (save)             LRU over --kv-offloading-size
         │                        ▲   │
         └─registered─▶ disk tier │   └──load──▶ device  prefix hit beyond the device pool
                  (write-through, ─fetch─┘               (a disk hit is fetched into a host
                   the next step)                         slot first, confirmed, then loaded)

When: a full block is saved to the host tier when the device pool evicts it (once: a key already
there is not saved again), and written to disk in the step after the one that computed it (its
KV is complete once the step that registered it has run), so a restart finds what was computed,
evicted or not. A prefix lookup that runs out of device blocks continues in the host tier: each
hit gets a fresh device block, registered under its key, filled by a load before the step's
forward, and counts as computed. Keys found only on disk are fetched into host slots and the
request waits one step; the step's result confirms each fetch or names the files that failed
(missing, truncated, corrupt, another layout), which are forgotten here, so a bad file is never
loaded into the device pool. Loads cost `load_tokens_per_block` tokens of the step's budget each.

Every step's operations are taken once (take_ops), when its plan is built: a device block named
by a save is read before anything in the same step overwrites it, and slots a step reads or
writes are pinned until then (host_index.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.contracts.step_plan import StepPlan, StepResult
from pagedserve.contracts.tier_ops import TierOps, TierSave
from pagedserve.scheduler.kv.block_pool import BlockPool
from pagedserve.scheduler.kv.tiers.disk_index import DiskIndex
from pagedserve.scheduler.kv.tiers.host_index import HostIndex

TIERS = ("device", "host", "disk")


@dataclass(slots=True)
class TierStats:
    """Running totals per tier: prefix blocks hit, bytes moved (replica-wide), evictions."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_read: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    bytes_written: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    evictions: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    num_failed_fetches: int = 0


@dataclass(slots=True)
class TierLookup:
    """Where a prefix continues after the device pool: host hits in order, then keys to fetch."""

    host: list[tuple[bytes, int]] = field(default_factory=list)  # (key, slot)
    disk: list[bytes] = field(default_factory=list)  # keys after the host run, found only on disk


class KvTiers:
    def __init__(self, *, num_host_blocks: int, disk_folder: str | None, max_disk_blocks: int,
                 num_block_bytes: int, world_size: int = 1, load_tokens_per_block: float = 1.0) -> None:
        self.host = HostIndex(num_host_blocks) if num_host_blocks > 0 else None
        self.disk = DiskIndex(max_disk_blocks) if disk_folder and max_disk_blocks > 0 else None
        self.disk_folder = disk_folder
        self.num_block_bytes = num_block_bytes  # one block over every rank
        self.load_tokens_per_block = load_tokens_per_block
        self.stats = TierStats()
        self._ops = TierOps()
        self._registered: list[tuple[int, bytes]] = []  # this step's: written to disk next step
        self._to_write: dict[bytes, int] = {}  # key -> device block, registered by an earlier step
        if self.disk is not None:
            self._ops.deletes += self.disk.load(disk_folder, world_size)

    @property
    def is_enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    # -- the device pool's events -------------------------------------------------------------
    def on_device_evict(self, block: int, key: bytes) -> None:
        """The pool hands a cached block to another use in this step: keep its KV."""
        self._to_write.pop(key, None)
        to_disk = self.disk is not None and key not in self.disk
        slot = -1
        if self.host is not None and key not in self.host:
            slot = self.host.put(key)
            slot = -1 if slot is None else slot
        if slot < 0 and not to_disk:
            return
        if slot >= 0:
            self.stats.bytes_written["host"] += self.num_block_bytes
        if to_disk:
            self._write_to_disk(key)
        self._ops.saves.append(TierSave(block, slot, key, to_disk))

    def on_registered(self, block: int, key: bytes) -> None:
        """A full block whose KV this step computes: written to disk by the next step."""
        if self.disk is not None and key not in self.disk:
            self._registered.append((block, key))

    # -- prefix lookups -----------------------------------------------------------------------
    def find(self, keys: list[bytes]) -> TierLookup:
        """Where the prefix continues, for the keys that missed the device pool (in order)."""
        found = TierLookup()
        for key in keys:
            slot = self.host.slot_of(key) if self.host is not None else None
            if slot is not None:
                if not found.disk:  # after a key to fetch it waits with the rest of the prefix
                    found.host.append((key, slot))
            elif self.host is not None and self.disk is not None and key in self.disk:
                found.disk.append(key)
            else:
                break
        return found

    def num_affordable_loads(self, num_hits: int, num_tokens_left: int) -> int:
        """Host hits the step's token budget can load, keeping one token for the prompt."""
        if self.load_tokens_per_block <= 0:
            return num_hits
        return max(0, min(num_hits, math.floor((num_tokens_left - 1) / self.load_tokens_per_block)))

    def load_cost(self, num_loads: int) -> int:
        return math.ceil(num_loads * self.load_tokens_per_block)

    def pin(self, hits: list[tuple[bytes, int]]) -> None:
        for key, _ in hits:
            self.host.touch(key)

    def load(self, slot: int, block: int, key: bytes) -> None:
        """The device block takes the host slot's KV before this step's forward."""
        self._ops.loads.append((slot, block))
        tier = "disk" if key in self.host.from_disk else "host"
        self.host.from_disk.discard(key)
        self.stats.hits[tier] += 1
        self.stats.bytes_read["host"] += self.num_block_bytes
        if self.disk is not None and key in self.disk:
            self.disk.touch(key)

    def fetch(self, keys: list[bytes]) -> bool:
        """Fetches keys from disk into host slots, as many as there are unpinned slots for;
        False when none is on its way (the caller then computes those blocks)."""
        num_issued = 0
        for key in keys:
            if key in self.host:
                num_issued += self.host.is_pending(key)  # another request's fetch: ready next step too
                continue
            slot = self.host.put(key, is_pending=True)
            if slot is None:
                break
            self._ops.fetches.append((key, slot))
            num_issued += 1
        return num_issued > 0

    # -- steps --------------------------------------------------------------------------------
    def take_ops(self, gpu_pool: BlockPool) -> TierOps | None:
        """This step's operations (None when there are none); registrations of earlier steps
        are written through to disk now that their KV is complete."""
        for key, block in self._to_write.items():
            if gpu_pool.block_keys[block] == key and self.disk is not None and key not in self.disk:
                self._write_to_disk(key)
                self._ops.saves.append(TierSave(block, -1, key, True))
        self._to_write = {key: block for block, key in self._registered}
        self._registered = []
        ops, self._ops = self._ops, TierOps()
        if self.host is not None:
            self.host.unpin_step()
        return None if ops.is_empty else ops

    def complete(self, plan: StepPlan, result: StepResult) -> None:
        """The step ran: its fetches are usable, except those the workers could not read."""
        ops = plan.tier_ops
        if ops is None or not ops.fetches:
            return
        failed = set(result.failed_fetch_keys)
        for key, _ in ops.fetches:
            if key in failed:
                self.host.drop(key)
                if self.disk is not None:
                    self.disk.drop(key)
                self.stats.num_failed_fetches += 1
            else:
                self.host.confirm(key)
                self.stats.bytes_read["disk"] += self.num_block_bytes

    def reset(self) -> None:
        """The workers restarted: host memory and any operation not yet run are lost (files
        already written stay; a write that was lost fails its fetch later)."""
        if self.host is not None:
            self.host.clear()
        self._ops = TierOps()
        self._registered, self._to_write = [], {}

    def evictions(self) -> dict[str, int]:
        return {"host": self.host.num_evictions if self.host is not None else 0,
                "disk": self.disk.num_evictions if self.disk is not None else 0}

    def _write_to_disk(self, key: bytes) -> None:
        self._ops.deletes += self.disk.add(key)
        self.stats.bytes_written["disk"] += self.num_block_bytes
