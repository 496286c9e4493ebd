"""Which prefix keys the workers' host tier holds, in which slot: least-recently-used, pinned
slots protected.

    slot state   in _slot_of       in _pending    pinned
    free         no                no             no
    ready        key -> slot       no             while a save or load of this step uses it
    pending      no                key -> slot    always (a fetch from disk is in flight)

A slot a step reads (a load) or writes (a save, a fetch) is pinned until the step's operations
are taken (unpin_step), so no later eviction in the same step hands it to another key before the
worker has run them. Pending slots stay pinned until the step's result confirms or fails them.
"""

from __future__ import annotations

from collections import OrderedDict


class HostIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, not {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # oldest first
        self._pending: dict[bytes, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.from_disk: set[bytes] = set()  # ready keys fetched from disk and not loaded since
        self.num_evictions = 0

    # -- lookups ----------------------------------------------------------------------------
    def slot_of(self, key: bytes) -> int | None:
        """The ready slot of key (pending ones are not usable yet)."""
        return self._slot_of.get(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of or key in self._pending

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    @property
    def num_ready(self) -> int:
        return len(self._slot_of)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- changes ----------------------------------------------------------------------------
    def touch(self, key: bytes) -> int:
        """Marks a ready key most recently used and pins its slot for this step."""
        self._slot_of.move_to_end(key)
        slot = self._slot_of[key]
        self._pinned.add(slot)
        return slot

    def put(self, key: bytes, *, is_pending: bool = False) -> int | None:
        """A pinned slot for key (a free one, else the least recently used unpinned ready one);
        None when every slot is pinned. The caller has checked that key is not here yet."""
        slot = self._take_slot()
        if slot is None:
            return None
        self._pinned.add(slot)
        if is_pending:
            self._pending[key] = slot
        else:
            self._slot_of[key] = slot
        return slot

    def confirm(self, key: bytes) -> None:
        """A fetch succeeded: its slot holds the key's KV."""
        slot = self._pending.pop(key, None)
        if slot is not None:
            self._slot_of[key] = slot
            self._pinned.discard(slot)
            self.from_disk.add(key)

    def drop(self, key: bytes) -> None:
        """Forgets key (a failed fetch); its slot is free again."""
        slot = self._pending.pop(key, None)
        if slot is None:
            slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._pinned.discard(slot)
            self._free.append(slot)
        self.from_disk.discard(key)

    def unpin_step(self) -> None:
        """The step's operations were taken: only pending fetches stay pinned."""
        self._pinned = set(self._pending.values())

    def clear(self) -> None:
        """The workers restarted: host memory is gone."""
        self.__init__(self.num_slots)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._slot_of.items():
            if slot not in self._pinned:
                del self._slot_of[key]
                self.from_disk.discard(key)
                self.num_evictions += 1
                return slot
        return None

    # -- inspection (invariants) ------------------------------------------------------------
    def check(self) -> None:
        """Raises ValueError when slots are lost, shared or out of range."""
        ready, pending = list(self._slot_of.values()), list(self._pending.values())
        taken = ready + pending
        if len(set(taken)) != len(taken):
            raise ValueError("host tier: a slot holds two keys")
        if set(taken) & set(self._free) or len(set(self._free)) != len(self._free):
            raise ValueError("host tier: a slot is both free and taken, or free twice")
        if len(taken) + len(self._free) != self.num_slots:
            raise ValueError(f"host tier: {len(taken)} taken + {len(self._free)} free != {self.num_slots}")
        if any(not 0 <= slot < self.num_slots for slot in taken):
            raise ValueError("host tier: a slot is out of range")
        if set(self._slot_of) & set(self._pending):
            raise ValueError("host tier: a key is both ready and pending")
        if not self.from_disk <= set(self._slot_of):
            raise ValueError("host tier: a key fetched from disk is not ready")
