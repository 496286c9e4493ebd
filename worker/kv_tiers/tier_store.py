"""One rank's KV tiers: host slots in memory (the blocks' K and V in tensors like the swap space,
pinned on CUDA) and block files in the layout's folder, and the step's tier operations on them
(pagedserve.contracts.tier_ops gives the order; ModelRunner.execute interleaves them with the
swaps and copies).

    save    device block -> host slot (a block copy), and/or a snapshot of its bytes queued for the
            disk writer (the file is encoded, checksummed and written on the writer's thread)
    fetch   block file -> host slot, checked (block_file.read); a bad file is removed and its key
            reported, agreed over the tensor-parallel group so that every rank drops it
    load    host slot -> device block (a block copy), before the step's forward

A block's bytes are the target model's K and V of every layer, then the draft model's (when its
KV shares the blocks): what the pool holds for it, whatever the KV dtype.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from pagedserve.contracts.tier_ops import TierOps, block_file_name
from pagedserve.kernels import ops
from pagedserve.worker.cache_engine import CacheEngine
from pagedserve.worker.kv_tiers import block_file
from pagedserve.worker.kv_tiers.disk_writer import DiskWriter


def _flat(caches) -> list[torch.Tensor]:
    return [tensor for pair in caches for tensor in pair]


def _mapping(pairs: list[tuple[int, int]]) -> torch.Tensor:  # [num_pairs, 2] int64
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


class TierStore:
    def __init__(self, cache: CacheEngine, num_host_blocks: int, *, folder: str | None, layout_id: str,
                 layout: dict, rank: int, tp=None) -> None:
        self.cache = cache
        self.num_host_blocks = num_host_blocks
        pin = cache.device.type == "cuda"
        cpu = torch.device("cpu")
        self.host = cache._allocate(num_host_blocks, cpu, pin=pin) if num_host_blocks else []
        self.draft_host = (cache._allocate(num_host_blocks, cpu, pin=pin, shape=cache.draft_shape)
                           if num_host_blocks and cache.draft_shape is not None else [])
        self.folder = folder
        self.writer = DiskWriter(folder) if folder else None
        self.layout_id = layout_id
        self.layout = layout
        self.rank = rank
        self.tp = tp
        self.payload_bytes = cache.bytes_per_block

    def _path(self, key: bytes) -> str:
        return os.path.join(self.folder, block_file_name(key, self.rank))

    def _host_tensors(self) -> list[torch.Tensor]:
        return _flat(self.host) + _flat(self.draft_host)

    def _device_tensors(self) -> list[torch.Tensor]:
        return _flat(self.cache.gpu_cache) + _flat(self.cache.draft_gpu_cache)

    def _check_slots(self, slots, what: str) -> None:
        bad = [slot for slot in slots if not 0 <= slot < self.num_host_blocks]
        if bad:
            raise ValueError(f"{what} host slots {bad[:8]} are outside [0, {self.num_host_blocks})")

    def _copy(self, src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        mapping = _mapping(pairs)
        for source, target in zip(src, dst):
            ops.swap_blocks(source, target, mapping)

    # -- the step's operations ----------------------------------------------------------------
    def save(self, tier_ops: TierOps) -> None:
        saves = tier_ops.saves
        to_host = [(save.block_id, save.host_slot) for save in saves if save.host_slot >= 0]
        if to_host:
            self._check_slots((slot for _, slot in to_host), "save")
            self.cache._check((block for block, _ in to_host), self.cache.num_gpu_blocks, "tier save")
            self._copy(self._device_tensors(), self._host_tensors(), to_host)
        if self.writer is not None:
            for save in saves:
                if save.to_disk:
                    source = (self._host_tensors(), save.host_slot) if save.host_slot >= 0 else \
                        (self._device_tensors(), save.block_id)
                    payload = _block_bytes(*source)
                    self.writer.write(self._path(save.key), partial(
                        block_file.encode, payload, key=save.key, rank=self.rank, layout_id=self.layout_id,
                        layout=self.layout))
            for key in tier_ops.deletes:
                self.writer.remove(self._path(key))

    def fetch(self, tier_ops: TierOps) -> list[bytes]:
        """Reads the fetched block files into their host slots; the keys that failed on any rank."""
        if not tier_ops.fetches:
            return []
        self._check_slots((slot for _, slot in tier_ops.fetches), "fetch")
        failed = []
        tensors = self._host_tensors()
        for key, slot in tier_ops.fetches:
            if self.folder is None:
                failed.append(True)
                continue
            try:
                payload = block_file.read(self._path(key), key=key, rank=self.rank, layout_id=self.layout_id,
                                          payload_bytes=self.payload_bytes)
                _fill(tensors, slot, payload)
                failed.append(False)
            except block_file.BadBlockFile:
                block_file.remove(self._path(key))
                failed.append(True)
        flags = torch.tensor(failed, dtype=torch.int32)
        if self.tp is not None and self.tp.world_size > 1:
            device = self.cache.device
            flags = self.tp.all_reduce(flags.to(device)).cpu()
        return [key for (key, _), flag in zip(tier_ops.fetches, flags.tolist()) if flag]

    def load(self, tier_ops: TierOps) -> None:
        if not tier_ops.loads:
            return
        self._check_slots((slot for slot, _ in tier_ops.loads), "load")
        self.cache._check((block for _, block in tier_ops.loads), self.cache.num_gpu_blocks, "tier load")
        self._copy(self._host_tensors(), self._device_tensors(), tier_ops.loads)


def _block_bytes(tensors: list[torch.Tensor], index: int) -> bytes:
    parts = [tensor[index].reshape(-1).view(torch.uint8) for tensor in tensors]
    return torch.cat(parts).cpu().numpy().tobytes()


def _fill(tensors: list[torch.Tensor], index: int, payload: bytes) -> None:
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0
    for tensor in tensors:
        target = tensor[index].view(torch.uint8).reshape(-1)
        target.copy_(data[offset:offset + target.numel()])
        offset += target.numel()
