"""Weights in memory that Linux backs with 2 MiB pages (transparent huge pages).

A decode step of a small model reads every weight once, so it runs as fast as the weights stream
in. Spread over 4 KiB pages, the step's few hundred megabytes take one TLB miss per page, and
the hardware prefetchers stop at every page's end; on 2 MiB pages neither happens. On AMD EPYC
(Zen 4), SmolLM2-135M's bfloat16 forward at one sequence took 10.98 ms before this module against
9.96 ms with it (bench/forward_ab.py, interleaved in one process; docs/cpu-limits.md).

Where the host leaves huge pages to the program (/sys/kernel/mm/transparent_hugepage/enabled is
`madvise`, the common default) torch's allocator does not ask for them. So after the load every
CPU tensor the model holds (parameters, buffers, and the prepacked panels, GGUF blocks and
quantized codes beside them) is copied once into one anonymous mapping that starts on a 2 MiB
boundary and is marked MADV_HUGEPAGE before its first touch; each tensor is then re-pointed into
it in place (`Tensor.set_`, each storage over its own bytes of the mapping), so every reference
to it, a tied LM head included, sees the new memory and the same values.

    move_to_huge_pages(model)               # -> bytes moved (0: no huge pages on this host)
    huge_page_buffer(num_bytes)             # an untouched uint8 tensor on 2 MiB pages
    is_marked(tensor)                       # its memory is marked MADV_HUGEPAGE (/proc/self/smaps)

The kernels' per-host tuning (kernels/native/tuning.py) measures on weights in such a buffer too,
so that what it chooses holds for the pages the worker serves from.

The KV caches stay on ordinary pages: a fault in memory marked MADV_HUGEPAGE may compact memory
to find a free 2 MiB page (the host's `defrag` setting), and zeroing a 2 GiB pool that way took
the worker 4.4 s instead of 0.8 on AMD EPYC. A pool's pages are now faulted in as its blocks are
first written (worker/cache_engine.py), during steps, where such a stall would fall on a request;
and a decode step reads its weights once but only the few blocks of its sequences.

Nothing changes where the host has no transparent huge pages (`never`, or not Linux), or under
PAGEDSERVE_HUGE_PAGES=0. It is advice: the kernel may still back some of the buffer with 4 KiB
pages when it cannot find free 2 MiB ones, and the values are the same either way.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line in the buffer
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV = "PAGEDSERVE_HUGE_PAGES"


def available() -> bool:
    """Whether this host gives transparent huge pages to a program that asks (`always` or
    `madvise`), and PAGEDSERVE_HUGE_PAGES is not 0."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def _mapping(num_bytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping (a shared one is shmem, whose huge pages hosts leave off) with
    num_bytes from a 2 MiB boundary, that range marked MADV_HUGEPAGE before anything touches it;
    -> (the mapping, the range's offset in it)."""
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    start = -address % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, start, num_bytes)
    return mapping, start


def huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """An untouched uint8 CPU tensor of num_bytes starting on a 2 MiB boundary, on memory marked
    MADV_HUGEPAGE (when available(); a plain torch.empty otherwise). Its storage holds only these
    bytes (torch.save of it writes num_bytes) and keeps the mapping alive."""
    if not available() or num_bytes == 0:
        return torch.empty(num_bytes, dtype=torch.uint8)
    mapping, start = _mapping(num_bytes)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes, offset=start)


def mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of this process's mapping that holds `address` (KeyError if
    none does)."""
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                if fields is not None:
                    break
                start, end = (int(value, 16) for value in head.split("-"))
                if start <= address < end:
                    fields = {}
            elif fields is not None:
                fields[head.rstrip(":")] = rest.strip()
    if fields is None:
        raise KeyError(f"no mapping holds {address:#x}")
    return fields


def is_marked(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory lies in a mapping marked MADV_HUGEPAGE (VmFlags `hg`)."""
    return "hg" in mapping_fields(tensor.data_ptr())["VmFlags"].split()


def _tensors(value, depth: int = 0):
    """The tensors in an attribute's value: a tensor, a dataclass of tensors (PanelWeight,
    BlockQuantWeight, the quantized layouts), or a list or tuple of those."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 2 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name), depth + 1)
    elif depth < 2 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every dense CPU tensor the model's modules hold (parameters, buffers, other attributes),
    each tensor object once."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        values = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for tensor in (t for value in values for t in _tensors(value)):
            if tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_mkldnn:
                found.setdefault(id(tensor), tensor)
    return list(found.values())


def move_to_huge_pages(model: torch.nn.Module) -> int:
    """Copies every tensor of model_tensors(model) into one buffer on 2 MiB pages and re-points it
    there in place; returns the bytes moved (0 when not available())."""
    if not available():
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    storages = {}
    for tensor in model_tensors(model):
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        by_storage.setdefault(storage.data_ptr(), []).append(tensor)
        storages[storage.data_ptr()] = storage
    offsets, total = {}, 0
    for key, storage in storages.items():
        offsets[key] = total
        total += -(-storage.nbytes() // ALIGN) * ALIGN
    if total == 0:
        return 0
    mapping, start = _mapping(total)
    with torch.no_grad():
        for key, tensors in by_storage.items():
            storage, offset = storages.pop(key), offsets[key]  # the old storage is freed once re-pointed
            # a storage of its own over its bytes of the mapping: saving or sharing a tensor takes
            # its own bytes, not the whole model
            target = torch.frombuffer(mapping, dtype=torch.uint8, count=storage.nbytes(), offset=start + offset)
            target.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            del storage
            for tensor in tensors:
                tensor.set_(target.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    return total
