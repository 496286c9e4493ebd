"""A GGUF file's header read quickly: its metadata keys and its tensors, as gguf.GGUFReader gives them.

GGUFReader builds numpy views of every item of every array in the header before it returns; for
a model with a 49k-token vocabulary and its merges that is about 200,000 small arrays, seconds of
CPU in each process that opens the file (the frontend, the scheduler and every worker rank).
This reader walks the header with `struct` once and decodes an array only when its `contents()`
are asked for; the tensors are the same `gguf.ReaderTensor`s over a read-only memory map.

    header = GGUFHeader(path)             # ValueError for a file that is not a readable GGUF
    header.fields["general.architecture"].contents()       # -> "llama"
    header.tensors[0].name, .tensor_type, .shape, .data    # as GGUFReader's

Little-endian files only (all that llama.cpp writes by default); `open_gguf` falls back to
GGUFReader for any other. tests/test_gguf_header.py compares every field and tensor with
GGUFReader's on the tiny and the real model's files.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # GGUFValueType
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
SCALAR_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
ELEMENT_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}  # other tensor types are bytes, as in GGUFReader


class NotLittleEndian(ValueError):
    """The file's version reads byte-swapped: written for a big-endian host."""


class HeaderField:
    """One metadata value; `types` as GGUFReader lists them ([ARRAY, item type] for an array)."""

    def __init__(self, name: str, types: list[int], value=None, array: tuple[bytes, int, int] | None = None) -> None:
        self.name = name
        self.types = types
        self._value = value
        self._array = array  # (buffer, offset of the first item, number of items)

    def contents(self):
        """The value as GGUFReader's ReaderField.contents() gives it: a Python scalar or str, or a list."""
        if self._array is None:
            return self._value
        buffer, offset, count = self._array
        item_type = self.types[-1]
        if item_type == STRING:
            items = []
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buffer, offset)
                items.append(str(buffer[offset + 8:offset + 8 + length], encoding="utf-8"))
                offset += 8 + length
            return items
        return np.frombuffer(buffer, dtype=np.dtype(SCALAR_DTYPES[item_type]).newbyteorder("<"), count=count,
                             offset=offset).tolist()


class GGUFHeader:
    """The metadata (`fields`, in file order) and tensors of a little-endian GGUF file."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        self.data = np.memmap(path, mode="r")
        buffer = memoryview(self.data)
        try:
            if bytes(buffer[:4]) != GGUF_MAGIC:
                raise ValueError("GGUF magic invalid")
            (version,) = struct.unpack_from("<I", buffer, 4)
            if version & 0xFFFF == 0:
                raise NotLittleEndian("the file is big-endian")
            if version not in SUPPORTED_VERSIONS:
                raise ValueError(f"GGUF version {version} is not supported")
            num_tensors, num_fields = struct.unpack_from("<QQ", buffer, 8)
            self.fields: OrderedDict[str, HeaderField] = OrderedDict()
            for name, value_type, value in (("GGUF.version", 4, version), ("GGUF.tensor_count", 10, num_tensors),
                                            ("GGUF.kv_count", 10, num_fields)):
                self.fields[name] = HeaderField(name, [value_type], value)
            offset = 24
            for _ in range(num_fields):
                name, offset = _string(buffer, offset)
                (value_type,) = struct.unpack_from("<I", buffer, offset)
                field, offset = _value(buffer, offset + 4, name, value_type)
                if name in self.fields:
                    raise KeyError(f"duplicate metadata key {name}")
                self.fields[name] = field
            infos = []
            for _ in range(num_tensors):
                name, offset = _string(buffer, offset)
                (num_dims,) = struct.unpack_from("<I", buffer, offset)
                dims = np.frombuffer(buffer, dtype="<u8", count=num_dims, offset=offset + 4).copy()
                raw_type, data_offset = struct.unpack_from("<IQ", buffer, offset + 4 + 8 * num_dims)
                offset += 4 + 8 * num_dims + 12
                infos.append((name, dims, raw_type, data_offset))
            alignment = DEFAULT_ALIGNMENT
            if "general.alignment" in self.fields:
                field = self.fields["general.alignment"]
                if field.types != [4]:
                    raise ValueError("bad type for general.alignment")
                alignment = field.contents()
                if alignment == 0 or alignment & (alignment - 1):
                    raise ValueError("invalid alignment: must be a non-zero power of two")
            self.data_offset = offset + (-offset % alignment)
            self.tensors = []
            names = set()
            for name, dims, raw_type, data_offset in infos:
                if name in names:
                    raise ValueError(f"duplicated tensor {name}")
                names.add(name)
                ggml_type = GGMLQuantizationType(raw_type)
                num_elements = int(np.prod(dims))
                block_size, type_size = GGML_QUANT_SIZES[ggml_type]
                num_bytes = num_elements * type_size // block_size
                start = self.data_offset + int(data_offset)
                np_dims = tuple(reversed(dims.tolist()))
                element = ELEMENT_DTYPES.get(ggml_type.name)
                if element is None:
                    element, count, np_dims = np.uint8, num_bytes, quant_shape_to_byte_shape(np_dims, ggml_type)
                else:
                    count = num_elements
                itemsize = np.dtype(element).itemsize
                if start + count * itemsize > len(self.data):
                    raise ValueError(f"tensor {name} runs past the end of the file")
                data = self.data[start:start + count * itemsize].view(element)[:count].reshape(np_dims)
                self.tensors.append(ReaderTensor(name=name, tensor_type=ggml_type, shape=dims,
                                                 n_elements=num_elements, n_bytes=num_bytes, data_offset=start,
                                                 data=data, field=None))
        except struct.error as exc:
            raise ValueError(f"the header ends early: {exc}") from None


def _string(buffer, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, offset)
    end = offset + 8 + length
    if end > len(buffer):
        raise ValueError("a string runs past the end of the file")
    return str(buffer[offset + 8:end], encoding="utf-8"), end


def _value(buffer, offset: int, name: str, value_type: int) -> tuple[HeaderField, int]:
    """The field of a value at offset (after its type), and the offset after it."""
    if value_type == STRING:
        text, end = _string(buffer, offset)
        return HeaderField(name, [STRING], text), end
    if value_type in SCALAR_FORMATS:
        fmt = "<" + SCALAR_FORMATS[value_type]
        (value,) = struct.unpack_from(fmt, buffer, offset)
        return HeaderField(name, [value_type], value), offset + struct.calcsize(fmt)
    if value_type != ARRAY:
        raise ValueError(f"metadata key {name} has unknown value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", buffer, offset)
    start = offset + 12
    if item_type == STRING:
        end = start
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", buffer, end)
            end += 8 + length
        if end > len(buffer):
            raise ValueError(f"array {name} runs past the end of the file")
    elif item_type in SCALAR_FORMATS:
        end = start + count * struct.calcsize("<" + SCALAR_FORMATS[item_type])
        if end > len(buffer):
            raise ValueError(f"array {name} runs past the end of the file")
    else:
        raise ValueError(f"array {name} has items of type {item_type}, which this reader does not read")
    return HeaderField(name, [ARRAY, item_type], array=(buffer, start, count)), end
