"""One parse of a GGUF file: its metadata, its tensor table, and its tensor data mapped.

The HF config, the tokenizer and the weights of a GGUF model are all derived from one
`GGUFFile` (see gguf_loader.py). `gguf.GGUFReader` is not used: it materialises every
field as numpy views (about 2 s for SmolLM2's 100k tokenizer strings on a fast core),
and transformers' GGUF config and tokenizer loaders each run a parse of their own, so a
start paid for three. This reader walks the header once with `struct` over a memory
map and leaves the tensor data untouched until a tensor is dequantized.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

# GGUF value types with a fixed size, as struct formats.
_SCALAR_FORMATS: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent

# Tensor types stored as plain numbers (GGUFReader's convention): the rest are
# quantization blocks, handed to the dequantizer as bytes.
_PLAIN_TYPES: dict[int, type] = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives: `shape` in torch order (slowest dimension first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: every metadata value (arrays as lists) and every tensor."""

    path: str
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_start: int
    blob: np.ndarray = field(repr=False, compare=False)  # the file, memory-mapped

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's stored data as a read-only view of the mapped file: numbers for
        F32/F16, otherwise the quantization blocks as bytes, one row per output row
        (what `gguf.quants.dequantize` takes)."""
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        if info.ggml_type in _PLAIN_TYPES:
            dtype, shape = _PLAIN_TYPES[info.ggml_type], info.shape
        else:
            dtype, shape = np.uint8, gguf.quants.quant_shape_to_byte_shape(info.shape, qtype)
        count = int(np.prod(shape))
        start = self.data_start + info.offset
        raw = self.blob[start : start + count * np.dtype(dtype).itemsize]
        return raw.view(dtype).reshape(shape)


def read_gguf_file(path: str) -> GGUFFile:
    """Parse the header of the GGUF file at `path` (metadata and tensor table)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        reader = _HeaderReader(mapped, path)
        metadata, tensors = _read_header(reader)
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-reader.pos // alignment) * alignment
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    return GGUFFile(os.path.abspath(path), metadata, tuple(tensors), data_start, blob)


def _read_header(reader: _HeaderReader) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    magic, version = reader.unpack("<II")
    if magic != gguf.GGUF_MAGIC or not 2 <= version <= 0xFFFF:  # also rejects big-endian
        raise ValueError(f"{reader.path} is not a little-endian GGUF v2+ file")
    n_tensors, n_kv = reader.unpack("<QQ")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack("<I")[0], key)
    tensors = []
    for _ in range(n_tensors):
        name = reader.string()
        (n_dims,) = reader.unpack("<I")
        dims = reader.unpack(f"<{n_dims}Q")
        ggml_type, offset = reader.unpack("<IQ")
        # GGUF lists dims fastest-first (ggml's ne); torch wants them reversed.
        tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, offset))
    return metadata, tensors


class _HeaderReader:
    """Sequential little-endian reads over the header bytes."""

    def __init__(self, blob: mmap.mmap, path: str) -> None:
        self.blob = blob
        self.path = path
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(fmt, self.blob, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: the GGUF header is truncated") from None
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        start, self.pos = self.pos, self.pos + length
        if self.pos > len(self.blob):
            raise ValueError(f"{self.path}: the GGUF header is truncated")
        return self.blob[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            etype, count = self.unpack("<IQ")
            if etype == gguf.GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if etype in _SCALAR_FORMATS:
                return list(self.unpack(f"<{count}{_SCALAR_FORMATS[etype]}"))
            raise ValueError(f"{self.path}: unsupported nested GGUF array for key {key!r}")
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} for key {key!r}")
        return self.unpack("<" + _SCALAR_FORMATS[vtype])[0]
