"""A GGUF file's layout, read with every length checked against the file first.

gguf.GGUFReader trusts the file: a truncated or corrupted one surfaces as struct.error, a numpy
error, a RecursionError, or an allocation sized by a garbage count. This reads the same sections:

    magic "GGUF", version u32 (2 or 3), tensor count u64, key/value count u64
    key/values:   key (u64 length + UTF-8), value type u32, value
                  (scalars; string = u64 length + bytes; array = item type u32, count u64, items)
    tensor infos: name, n_dims u32 (<= 4), dims u64 x n_dims, ggml type u32, offset u64
    padding to general.alignment (default 32), then the tensor data

Every count and length is bounded by the bytes left in the file before anything is allocated;
arrays nest at most MAX_ARRAY_DEPTH deep; each tensor's span (dims x type size) lies inside the
file, aligned, and overlaps no other. Any failure is a filecheck.ModelFileError naming the field
and its byte offset. The values come back as gguf.ReaderField.contents() gives them (str, int,
float, bool, lists).
"""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from skippy_zmq.files.filecheck import Cursor, ModelFileError

VERSIONS = (2, 3)
MAX_DIMS = 4                        # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2                 # an array of arrays at most (llama.cpp reads none nested)
HEADER_BYTES = 24
# GGUF value types (gguf.GGUFValueType): numpy dtype of each scalar; 8 string, 9 array
SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
           11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    dims: tuple[int, ...]           # GGUF order: innermost first
    offset: int                     # absolute byte offset in the file
    nbytes: int


@dataclasses.dataclass(frozen=True)
class GGUFLayout:
    path: str
    version: int
    fields: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    size: int


def read_gguf_layout(path: str | Path) -> GGUFLayout:
    """Parse and validate a GGUF file's header, key/values and tensor infos (data is not read)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ModelFileError(path, "file", None, f"cannot read: {exc.strerror or exc}") from None
    if size < HEADER_BYTES:
        raw = path.read_bytes()
        if raw[:4] != b"GGUF"[:len(raw)]:
            raise ModelFileError(path, "magic", 0, "not a GGUF file (bad magic)")
        raise ModelFileError(path, "header", 0, f"{size} bytes, a GGUF header needs {HEADER_BYTES} (truncated)")
    # mapped, not read: a whole model's GGUF holds its weights after the metadata
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _parse(Cursor(path, data))


def _parse(cur: Cursor) -> GGUFLayout:
    if cur.take(4, "magic") != b"GGUF":
        raise cur.fail("magic", "not a GGUF file (bad magic)", 0)
    (version,) = cur.unpack("<I", "version")
    if version not in VERSIONS:
        raise cur.fail("version", f"version {version} is not one of {VERSIONS} (or a big-endian file)", 4)
    n_tensors, n_kv = cur.unpack("<QQ", "counts")
    # a key/value takes at least 13 bytes and a tensor info 24: bound the counts by the file first
    if n_kv * 13 > cur.size - cur.pos:
        raise cur.fail("kv_count", f"{n_kv} key/values cannot fit in the {cur.size - cur.pos} bytes left", 16)
    if n_tensors * 24 > cur.size - cur.pos:
        raise cur.fail("tensor_count", f"{n_tensors} tensor infos cannot fit in the {cur.size - cur.pos} "
                                       "bytes left", 8)
    fields: dict[str, Any] = {}
    for i in range(n_kv):
        at = cur.pos
        key = _string(cur, f"kv[{i}].key")
        if key in fields:
            raise cur.fail(f"kv[{i}].key", f"duplicate key {key!r}", at)
        (kind,) = cur.unpack("<I", f"kv {key!r} type")
        fields[key] = _value(cur, kind, f"kv {key!r} value", 0)
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    alignment = fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise cur.fail("kv 'general.alignment'", f"{alignment!r} is not a power of two", None)
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _place_tensors(cur, infos, data_offset, alignment)
    return GGUFLayout(cur.path, version, fields, tensors, alignment, data_offset, cur.size)


def _string(cur: Cursor, field: str) -> str:
    at = cur.pos
    (n,) = cur.unpack("<Q", f"{field} length")
    cur.need(n, f"{field} length", at)
    return cur.text(n, field)


def _value(cur: Cursor, kind: int, field: str, depth: int) -> Any:
    if kind == STRING:
        return _string(cur, field)
    if kind in SCALARS:
        dtype = np.dtype(SCALARS[kind])
        cur.need(dtype.itemsize, field)
        value = np.frombuffer(cur.data, dtype, 1, cur.pos)[0].item()
        cur.pos += dtype.itemsize
        return bool(value) if kind == 7 else value
    if kind != ARRAY:
        raise cur.fail(f"{field} type", f"unknown GGUF value type {kind}", cur.pos - 4)
    if depth >= MAX_ARRAY_DEPTH:
        raise cur.fail(field, f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
    at = cur.pos
    item, n = cur.unpack("<IQ", f"{field} item type and count")
    if item in SCALARS:
        dtype = np.dtype(SCALARS[item])
        cur.need(n * dtype.itemsize, f"{field} count ({n} x {dtype.name})", at)
        values = np.frombuffer(cur.data, dtype, n, cur.pos)
        cur.pos += values.nbytes
        return values.astype(bool).tolist() if item == 7 else values.tolist()
    # strings take at least 8 bytes each, arrays 12: bound the count before the loop
    cur.need(n * (8 if item == STRING else 12), f"{field} count ({n} items of type {item})", at)
    return [_value(cur, item, f"{field}[{j}]", depth + 1) for j in range(n)]


def _tensor_info(cur: Cursor, i: int) -> tuple[str, int, tuple[int, ...], int, int]:
    at = cur.pos
    name = _string(cur, f"tensor_info[{i}].name")
    field = f"tensor_info[{i}] {name!r}"
    (n_dims,) = cur.unpack("<I", f"{field} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"{field} n_dims", f"{n_dims} dimensions (1..{MAX_DIMS})", cur.pos - 4)
    dims = cur.unpack(f"<{n_dims}Q", f"{field} dims")
    ggml_type, offset = cur.unpack("<IQ", f"{field} type and offset")
    return name, ggml_type, tuple(dims), offset, at


def _place_tensors(cur: Cursor, infos: list[tuple[str, int, tuple[int, ...], int, int]], data_offset: int,
                   alignment: int) -> tuple[TensorInfo, ...]:
    """Each tensor's byte span from its dims and type, checked inside the file, aligned, disjoint."""
    tensors, seen = [], set()
    for i, (name, ggml_type, dims, offset, at) in enumerate(infos):
        field = f"tensor_info[{i}] {name!r}"
        if name in seen:
            raise cur.fail(f"{field} name", "duplicate tensor name", at)
        seen.add(name)
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise cur.fail(f"{field} type", f"unknown ggml type {ggml_type}", at) from None
        if dims[0] % block:
            raise cur.fail(f"{field} dims", f"inner dimension {dims[0]} is not a multiple of the "
                                            f"{block}-element block of its type", at)
        elements = int(np.prod(dims, dtype=object))
        nbytes = elements // block * type_bytes
        start = data_offset + offset
        if offset % alignment or start + nbytes > cur.size:
            raise cur.fail(f"{field} offset", f"data [{start}, {start + nbytes}) is not an aligned span "
                                              f"inside the {cur.size}-byte file", at)
        tensors.append(TensorInfo(name, ggml_type, dims, start, nbytes))
    spans = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(spans, spans[1:]):
        if b.offset < a.offset + a.nbytes:
            raise cur.fail(f"tensor {b.name!r} offset", f"overlaps tensor {a.name!r}", b.offset)
    return tuple(tensors)
