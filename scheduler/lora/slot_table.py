"""The workers' LoRA adapter slots as the scheduler owns them (no torch), like it owns KV blocks.

Every worker has max_loras slots; the scheduler decides what each holds. A step may use at most
max_loras distinct adapters: each sequence of an adapter request needs its adapter in a slot for
the step it is scheduled in. `acquire` is asked per group while the step is built, in the order
groups are served (running first, then swapped and waiting by queue order):

    the adapter is in a slot             -> that slot (marked used by this step, most recent in LRU)
    a slot is empty or unused this step  -> the least recently used such slot; the plan tells the
                                            workers to load the adapter there (an eviction when it
                                            held another adapter)
    every slot is used by this step      -> None: the group is not scheduled in this step

Slots are keyed by the adapter's content digest, so a reloaded adapter with other weights under
the same name goes to a slot of its own. A group that gets no slot keeps its place in its queue:
waiting groups behind it wait too (the first that does not fit stops admission), so FCFS and
priority order hold.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedserve.contracts.request_types import AdapterRef
from pagedserve.contracts.step_plan import LoraLoad


class LoraSlotTable:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, not {max_loras}")
        self.max_loras = max_loras
        self.slots: list[str | None] = [None] * max_loras  # the digest each worker slot holds
        self._lru: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))
        self._used: set[int] = set()  # slots the step being built uses
        self._loads: list[LoraLoad] = []
        self.num_loads = 0
        self.num_evictions = 0  # loads that replaced another adapter

    def begin_step(self) -> None:
        self._used.clear()
        self._loads = []

    def acquire(self, adapter: AdapterRef) -> int | None:
        """The slot holding adapter in this step, or None when every slot is taken by this step."""
        if adapter.digest in self.slots:
            slot = self.slots.index(adapter.digest)
        else:
            slot = next((s for s in self._lru if s not in self._used), None)
            if slot is None:
                return None
            if self.slots[slot] is not None:
                self.num_evictions += 1
            self.slots[slot] = adapter.digest
            self.num_loads += 1
            self._loads.append(LoraLoad(slot, adapter.name, adapter.path, adapter.digest))
        self._used.add(slot)
        self._lru.move_to_end(slot)
        return slot

    def can_acquire(self, adapter: AdapterRef) -> bool:
        return adapter.digest in self.slots or len(self._used) < self.max_loras

    def take_loads(self) -> list[LoraLoad]:
        loads, self._loads = self._loads, []
        return loads

    @property
    def num_used(self) -> int:
        return len(self._used)

    def reset(self) -> None:
        """The workers restarted: every slot is empty again."""
        self.slots = [None] * self.max_loras
        self._lru = OrderedDict((slot, None) for slot in range(self.max_loras))
        self.begin_step()
