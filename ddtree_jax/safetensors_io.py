"""Minimal safetensors reader/writer over numpy (bf16 via ml_dtypes), memory-mapped.

The `safetensors` package's numpy backend cannot hold bfloat16; this one can,
and its errors name the file and tensor.
"""

from __future__ import annotations

import json
import os
import struct as pystruct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A missing, extra, mis-shaped or corrupt weight, with file and tensor named."""


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(tensor table, byte offset of the data section) of one .safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header)")
        (n,) = pystruct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{path}: corrupt safetensors header (claims {n} bytes, file has {size})")
        try:
            table = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(table, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    table.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in table.items():
        try:
            begin, end = info["data_offsets"]
            dtype = DTYPES[info["dtype"]]
            count = int(np.prod(info["shape"], dtype=np.int64))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r} has a bad header entry ({e!r})") from None
        if not 0 <= begin <= end <= data_size or end - begin != count * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({info['dtype']} {info['shape']}) has data offsets "
                f"[{begin}, {end}) that do not fit the file ({data_size} data bytes)"
            )
    return table, 8 + n


class SafetensorsFile:
    """Lazy, memory-mapped access to the tensors of one file."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.table, self.offset = read_header(path)
        self._mmap = None

    def keys(self):
        return self.table.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.table[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        info = self.table[name]
        begin, end = info["data_offsets"]
        buf = self._mmap[self.offset + begin : self.offset + end]
        return buf.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Writes numpy arrays (any dtype in DTYPES) as one .safetensors file."""
    table: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = {}
    for name, value in tensors.items():
        a = np.ascontiguousarray(value)
        if a.dtype not in NAMES:
            raise CheckpointError(f"cannot write tensor {name!r} of dtype {a.dtype}")
        table[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays[name] = a
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(pystruct.pack("<Q", len(header)))
        f.write(header)
        for a in arrays.values():
            f.write(a.tobytes())
