"""The worker's adapter slots and the LoRA delta added to each projection of a mixed batch.

The scheduler assigns each sequence a slot (ScheduledSeq.lora_slot, -1: the base model) and says
which adapter each slot holds (StepPlan.lora_loads). Before a forward, `rows_for_step` groups the
token rows by slot; forward hooks on every qkv/o/gate_up/down layer then add, for each slot s
with rows R_s (Punica's gather, done as one matmul pair per slot and layer on CPU; the fused
parts of a layer share it, see adapter_weights.py):

    y[R_s] += (x[R_s] @ A_s^T) @ B_s^T                  column layers (qkv, gate_up)
    y[R_s] += all_reduce(x[R_s] @ A_s^T) @ B_s^T        row layers (o, down; A sliced by input columns)

A step whose rows all use one slot skips the gather and the scatter.

The base layers are left as they are (hooks add after their forward, quantized or not). Adapters
stay in host memory after they leave a slot, up to max_cpu_loras (LRU), keyed by content digest.

An adapter that cannot be loaded (its folder changed or vanished since the frontend checked it)
leaves its slot failed: the sequences that use the slot run as the base model and are reported as
failed (StepResult.failures), so their requests fail with the reason and every other goes on.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedserve.adapters.lora_config import LoraConfig
from pagedserve.adapters.peft_folder import AdapterError, model_shapes, read_adapter
from pagedserve.checkpoints.model_config import load_model_info
from pagedserve.contracts.step_plan import LoraLoad, ScheduledSeq
from pagedserve.worker.lora.adapter_weights import AdapterWeights, load_adapter_weights, model_shards

_Groups = list[tuple[int, torch.Tensor | None]]  # (slot, its token rows; None: every row of the step)


class LoraSlots:
    def __init__(self, model, config: LoraConfig, *, model_path, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.device = device
        self.tp = model.tp
        self.shapes = model_shapes(load_model_info(model_path))
        self.shards = model_shards(model)
        self.slots: list[AdapterWeights | None] = [None] * config.max_loras
        self.host: OrderedDict[str, AdapterWeights] = OrderedDict()  # digest -> weights, LRU first
        self.num_loads = 0  # adapters read from disk
        self.failed: dict[int, str] = {}  # slot -> why its adapter could not be loaded
        self.failed_seqs: dict[int, str] = {}  # this step's sequences on a failed slot -> why
        self._groups: _Groups = []
        for index, layer in enumerate(model.layers):
            attention, mlp = layer.self_attn, layer.mlp
            self._column(attention.qkv_proj, index, "qkv_proj")
            self._column(mlp.gate_up_proj, index, "gate_up_proj")
            self._row(attention.o_proj, index, "o_proj")
            self._row(mlp.down_proj, index, "down_proj")

    # -- slots ---------------------------------------------------------------------------------

    def load_or_fail(self, load: LoraLoad) -> None:
        """load(); when it cannot be done the slot is marked failed (its sequences fail) instead of raising."""
        try:
            self.load(load)
            self.failed.pop(load.slot, None)
        except ValueError as exc:  # AdapterError, or a slot beyond this worker's --max-loras
            if 0 <= load.slot < len(self.slots):
                self.slots[load.slot] = None
            self.failed[load.slot] = str(exc)

    def load(self, load: LoraLoad) -> None:
        """Puts the adapter in its slot (from host memory when it is there, else from its folder)."""
        if not 0 <= load.slot < len(self.slots):
            raise ValueError(f"LoRA slot {load.slot} is outside this worker's [0, {len(self.slots)}) "
                             "(--max-loras differs between scheduler and worker)")
        current = self.slots[load.slot]
        if current is not None and current.spec.digest == load.digest:
            return
        weights = self.host.pop(load.digest, None)
        if weights is None:
            spec = read_adapter(load.name, load.path, self.shapes, max_rank=self.config.max_lora_rank)
            if spec.digest != load.digest:
                raise AdapterError(f"adapter {load.name!r} at {load.path} changed since it was registered "
                                   f"(digest {spec.digest[:12]}, expected {load.digest[:12]}); load it again")
            weights = load_adapter_weights(spec, self.shards, dtype=self.dtype, device=self.device)
            self.num_loads += 1
        self.host[load.digest] = weights
        self.slots[load.slot] = weights
        resident = {w.spec.digest for w in self.slots if w is not None}
        while len(self.host) > max(self.config.num_cpu_loras, len(resident)):
            evictable = next((d for d in self.host if d not in resident), None)
            if evictable is None:
                break
            del self.host[evictable]

    def rows_for_step(self, seqs: list[ScheduledSeq]) -> None:
        """Groups the step's token rows by slot (for the hooks); sets model.lora_active."""
        groups: dict[int, list[int]] = {}
        self.failed_seqs = {}
        row = 0
        for seq in seqs:
            count = len(seq.token_ids)
            if seq.lora_slot in self.failed:
                self.failed_seqs[seq.seq_id] = self.failed[seq.lora_slot]
            elif seq.lora_slot >= 0:
                if seq.lora_slot >= len(self.slots) or self.slots[seq.lora_slot] is None:
                    raise AdapterError(f"sequence {seq.seq_id} uses LoRA slot {seq.lora_slot}, which holds no adapter")
                groups.setdefault(seq.lora_slot, []).extend(range(row, row + count))
            row += count
        if len(groups) == 1 and len(next(iter(groups.values()))) == row:  # one slot for every row
            self._groups = [(next(iter(groups)), None)]
        else:
            self._groups = [(slot, torch.tensor(rows, dtype=torch.int64, device=self.device))
                            for slot, rows in sorted(groups.items())]
        self.model.lora_active = bool(self._groups)

    def clear_step(self) -> None:
        self._groups = []
        self.failed_seqs = {}
        self.model.lora_active = False

    # -- the deltas ----------------------------------------------------------------------------

    def _column(self, module, layer: int, name: str) -> None:
        def add_delta(_module, args, output):
            if not self._groups:
                return None
            x = args[0]
            for slot, rows in self._groups:
                delta = self.slots[slot].deltas.get((layer, name))
                if delta is None:
                    continue
                if rows is None:  # every row of the step: no gather, no scatter
                    output.add_((x @ delta.a.T) @ delta.b.T)
                else:
                    output.index_add_(0, rows, (x.index_select(0, rows) @ delta.a.T) @ delta.b.T)
            return output

        module.register_forward_hook(add_delta)

    def _row(self, module, layer: int, name: str) -> None:
        if self.tp.world_size == 1:
            self._column(module, layer, name)  # the whole input: the same as a column layer
            return

        def add_delta(_module, args, output):
            if not self._groups:
                return None
            x = args[0]  # this rank's input columns: the rank-r products are partial sums
            deltas = [(self.slots[slot].deltas.get((layer, name)), rows) for slot, rows in self._groups]
            width = max((delta.a.shape[0] for delta, _ in deltas if delta is not None), default=1)
            shrunk = x.new_zeros((x.shape[0], width))  # [T, r]: each row belongs to one slot
            for delta, rows in deltas:
                if delta is not None:
                    rank = delta.a.shape[0]
                    if rows is None:
                        shrunk[:, :rank] = x @ delta.a.T
                    else:
                        shrunk[rows, :rank] = x.index_select(0, rows) @ delta.a.T
            shrunk = self.tp.all_reduce(shrunk)  # once for all slots; every rank runs it (same slots)
            for delta, rows in deltas:
                if delta is not None:
                    rank = delta.a.shape[0]
                    if rows is None:
                        output.add_(shrunk[:, :rank] @ delta.b.T)
                    else:
                        output.index_add_(0, rows, shrunk.index_select(0, rows)[:, :rank] @ delta.b.T)
            return output

        module.register_forward_hook(add_delta)
