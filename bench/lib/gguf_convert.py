"""The same weights in another GGUF tensor type: a Q4_1 GGUF dequantized to float32 or bfloat16,
for peers (llama.cpp) that should run in the precision pagedserve runs in.

    convert_gguf(source, "bfloat16")  ->  <cache>/gguf-dequantized/<stem>.BF16.gguf   (written once, then reused)

Every metadata field is copied as it is (tokenizer, chat template, hyperparameters) except the
file type. Every tensor is dequantized with gguf.quants.dequantize, the way the pagedserve worker
reads it; in bfloat16 files one-dimensional tensors (norm weights) stay float32, as llama.cpp's
own converter writes them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedserve.cache_root import cache_dir

FILE_TYPES = {"float32": ("F32", "ALL_F32"), "bfloat16": ("BF16", "MOSTLY_BF16")}


def converted_path(source: Path, dtype: str) -> Path:
    return cache_dir() / "gguf-dequantized" / f"{source.stem}.{FILE_TYPES[dtype][0]}.gguf"


def convert_gguf(source: Path, dtype: str) -> Path:
    """source dequantized into dtype (float32 or bfloat16); cached by name under <cache>/gguf-dequantized."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
    from gguf.quants import dequantize, quantize

    target = converted_path(source, dtype)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.part")
    reader = GGUFReader(source)
    architecture = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(partial, architecture)
    for field in reader.fields.values():
        if field.name in (Keys.General.ARCHITECTURE, Keys.General.FILE_TYPE) or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(getattr(LlamaFileType, FILE_TYPES[dtype][1]))
    for tensor in reader.tensors:
        values = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if dtype == "bfloat16" and values.ndim > 1:
            writer.add_tensor(tensor.name, quantize(values, GGMLQuantizationType.BF16),
                              raw_dtype=GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target
