"""The adapter slots of the groups scheduled in one step: the step builder's view of the
LoraSlotTable (slot_table.py). A group without an adapter, or a scheduler without --enable-lora,
always gets the base model (slot -1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.contracts.step_plan import LoraLoad
from pagedserve.scheduler.lora.slot_table import LoraSlotTable

if TYPE_CHECKING:
    from pagedserve.scheduler.core.sequence import SequenceGroup

BASE_MODEL_SLOT = -1


class StepAdapterSlots:
    def __init__(self, table: LoraSlotTable | None) -> None:
        self.table = table
        self._slot_of: dict[int, int] = {}  # id(group) -> its adapter's slot in this step
        if table is not None:
            table.begin_step()

    def can_acquire(self, group: SequenceGroup) -> bool:
        adapter = group.request.adapter
        return adapter is None or self.table is None or self.table.can_acquire(adapter)

    def acquire(self, group: SequenceGroup) -> bool:
        """Gives group's adapter a worker slot for this step (True without an adapter); False
        when every slot is taken by other adapters of this step."""
        adapter = group.request.adapter
        if adapter is None or self.table is None:
            return True
        slot = self.table.acquire(adapter)
        if slot is None:
            return False
        self._slot_of[id(group)] = slot
        return True

    def slot_of(self, group: SequenceGroup) -> int:
        return self._slot_of.get(id(group), BASE_MODEL_SLOT)

    def take_loads(self) -> list[LoraLoad]:
        """The adapters the workers load before this step's forward."""
        return self.table.take_loads() if self.table is not None else []
