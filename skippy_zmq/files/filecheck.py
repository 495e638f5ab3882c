"""Reading model files that come from outside: every length and offset is checked against the file
before anything is read or allocated, and a bad file fails at once with one error type naming the
file, the field and the byte offset (ModelFileError).

Here: the error, a bounded reader cursor, capped JSON reading and the safetensors header. The GGUF
layout (header, key/values, tensor infos, data spans) is files/gguf_layout.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


JSON_CAP_BYTES = 64 << 20                 # tokenizer.json of a 256k vocabulary is ~20 MB
SAFETENSORS_HEADER_CAP = 100 << 20        # safetensors' own reader refuses headers over 100 MB
# safetensors dtype -> bytes per element (the ones a checkpoint may hold; we read the float ones)
SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                        "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class ConvertError(ValueError):
    """The input cannot be converted; the message names what is wrong."""


class ModelFileError(ConvertError):
    """A model file is truncated or malformed: `path`, `field` and `offset` (bytes, or None) say where.

    A ConvertError (a ValueError), so `convert` reports it as any other conversion failure."""

    def __init__(self, path: str | Path, field: str, offset: int | None, problem: str) -> None:
        self.path, self.field, self.offset, self.problem = str(path), field, offset, problem
        where = "" if offset is None else f" at byte {offset}"
        super().__init__(f"{path}: {field}{where}: {problem}")


class Cursor:
    """Little-endian reads from a buffer (bytes or an mmap) that never go past its end."""

    def __init__(self, path: str | Path, data: Any, pos: int = 0) -> None:
        self.path, self.data, self.pos, self.size = str(path), data, pos, len(data)

    def fail(self, field: str, problem: str, offset: int | None = None) -> ModelFileError:
        return ModelFileError(self.path, field, self.pos if offset is None else offset, problem)

    def need(self, n: int, field: str, offset: int | None = None) -> None:
        """Raise unless n more bytes are in the file (n is checked before any allocation); `offset`:
        where the length or count that asked for them sits, if not here."""
        if n < 0 or n > self.size - self.pos:
            raise self.fail(field, f"needs {n} bytes, the file has {self.size - self.pos} left (truncated?)",
                            offset)

    def unpack(self, fmt: str, field: str) -> tuple[Any, ...]:
        n = struct.calcsize(fmt)
        self.need(n, field)
        out = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return out

    def take(self, n: int, field: str) -> bytes:
        self.need(n, field)
        out = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return out

    def text(self, n: int, field: str) -> str:
        at = self.pos
        raw = self.take(n, field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(field, f"not UTF-8 ({exc.reason} at +{exc.start})", at) from None


def read_text_capped(path: str | Path, field: str, cap: int = JSON_CAP_BYTES) -> str:
    """A UTF-8 text file of at most `cap` bytes (checked before it is read), else a ModelFileError."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(cap + 1)
    except OSError as exc:
        raise ModelFileError(path, field, None, f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > cap:
        raise ModelFileError(path, field, cap, f"over the {cap}-byte cap")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFileError(path, field, exc.start, "not UTF-8") from None


def read_json_capped(path: str | Path, field: str, cap: int = JSON_CAP_BYTES) -> Any:
    """A JSON file of at most `cap` bytes; too big, unreadable or malformed is a ModelFileError."""
    text = read_text_capped(path, field, cap)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFileError(path, field, exc.pos, f"not JSON: {exc.msg}") from None
    except RecursionError:
        raise ModelFileError(path, field, None, "JSON nested too deeply") from None


# ---------------------------------------------------------------- safetensors


def read_safetensors_header(path: str | Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """A safetensors file's tensors, validated: (byte where the data section starts, {name: info}).

    The header length is bounded by the file and SAFETENSORS_HEADER_CAP before it is read; every
    tensor has a known dtype, a shape of non-negative ints, data_offsets [begin, end] inside the
    data section with end - begin == elements x itemsize, and no two tensors overlap.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        cur = Cursor(path, f.read(8))
        cur.size = size                                     # bounds against the whole file
        (n,) = cur.unpack("<Q", "header length")
        if n > SAFETENSORS_HEADER_CAP:
            raise cur.fail("header length", f"{n} bytes, over the {SAFETENSORS_HEADER_CAP}-byte cap", 0)
        cur.need(n, "header")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelFileError(path, "header", 8, f"not a JSON object: {exc}") from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "header", 8, "not a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    tensors = {name: _safetensors_info(path, name, info, data_size)
               for name, info in header.items() if name != "__metadata__"}
    spans = sorted((info["data_offsets"], name) for name, info in tensors.items())
    for (a, name_a), (b, name_b) in zip(spans, spans[1:]):
        if b[0] < a[1]:
            raise ModelFileError(path, f"tensor {name_b!r} data_offsets", data_start + b[0],
                                 f"overlaps tensor {name_a!r} [{a[0]}, {a[1]})")
    return data_start, tensors


def _safetensors_info(path: Path, name: str, info: Any, data_size: int) -> dict[str, Any]:
    def bad(what: str, problem: str) -> ModelFileError:
        return ModelFileError(path, f"tensor {name!r} {what}", 8, problem)

    if not isinstance(info, dict):
        raise bad("entry", "not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_ITEMSIZE:
        raise bad("dtype", f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_uint(d) for d in shape):
        raise bad("shape", f"not a list of at most 8 non-negative ints: {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_uint(o) for o in offsets):
        raise bad("data_offsets", f"not [begin, end]: {offsets!r}")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise bad("data_offsets", f"[{begin}, {end}] is not inside the {data_size}-byte data section")
    elements = 1
    for d in shape:
        elements *= d
    if elements * SAFETENSORS_ITEMSIZE[dtype] != end - begin:
        raise bad("data_offsets", f"span of {end - begin} bytes, shape {shape} x {dtype} needs "
                                  f"{elements * SAFETENSORS_ITEMSIZE[dtype]}")
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
