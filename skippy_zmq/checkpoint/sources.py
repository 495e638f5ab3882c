"""Tensor sources for conversion: one tensor (or a block of its rows) at a time.

Both readers read the file with plain reads into fresh buffers, never through a
memory map: pages of a mapping that a conversion has touched stay resident and
count in its RSS, so mapping a 16 GB file would show a 16 GB peak.

`read(name, start, stop)` returns rows [start, stop) of an [out, in] tensor
(PyTorch / GGUF numpy order): float32, or for a GGUF matrix of a type we keep
(model/ggml.py) its raw blocks (formats.Blocks), so they reach the checkpoint
as they are (or, for int8 / q4, Q4_0 / Q4_1 / Q8_0 as their exact levels).
Vectors, and matrices of other GGUF types, are dequantised with the `gguf`
package, those rows alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from skippy_zmq.files.filecheck import read_safetensors_header
from skippy_zmq.files.gguf_layout import GGUFLayout
from skippy_zmq.text.vocab import MetaField
from skippy_zmq.checkpoint.formats import Blocks
from skippy_zmq.model import ggml

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
class SourceError(ValueError):
    """A tensor cannot be read; the message names it."""


def _read_at(f: Any, offset: int, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, np.uint8)
    f.seek(offset)
    if f.readinto(memoryview(buf)) != nbytes:
        raise SourceError(f"{f.name}: truncated at byte {offset}")
    return buf


class SafetensorsSource:
    """Every *.safetensors file of a directory, by tensor name (bf16 included)."""

    def __init__(self, directory: Path):
        self.files = sorted(Path(directory).glob("*.safetensors"))
        if not self.files:
            raise SourceError(f"{directory}: no *.safetensors files")
        self.index: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for file in self.files:
            data_start, tensors = read_safetensors_header(file)   # bounded and checked: ModelFileError
            for name, info in tensors.items():
                self.index[name] = (file, data_start, info)

    def shape(self, name: str) -> tuple[int, ...] | None:
        entry = self.index.get(name)
        return None if entry is None else tuple(entry[2]["shape"])

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        file, base, info = self.index[name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise SourceError(f"tensor {name}: unsupported dtype {info['dtype']}")
        shape = tuple(info["shape"])
        if not shape:
            raise SourceError(f"tensor {name}: a scalar, not a matrix or vector")
        stop = shape[0] if stop is None else min(stop, shape[0])
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
        with open(file, "rb") as f:
            raw = _read_at(f, base + info["data_offsets"][0] + start * row, (stop - start) * row)
        return raw.view(dtype).reshape(stop - start, *shape[1:]).astype(np.float32)


class GGUFTensor:
    """One tensor of a GGUF file under gguf.ReaderTensor's names: `shape` inner dimension first,
    `data_offset` absolute; `data` (its raw bytes, for the small tensors a config reads) by a plain read."""

    def __init__(self, path: str, name: str, ggml_type: int, dims: tuple[int, ...], offset: int, nbytes: int):
        from gguf import GGMLQuantizationType

        self.path, self.name, self.data_offset, self.n_bytes = path, name, offset, nbytes
        self.tensor_type = GGMLQuantizationType(ggml_type)
        self.shape = np.array(dims, np.uint64)

    @property
    def data(self) -> np.ndarray:
        with open(self.path, "rb") as f:
            return _read_at(f, self.data_offset, self.n_bytes)


class GGUFFile:
    """What a conversion reads of a GGUF file, from its checked layout (files/gguf_layout): `fields`
    (key -> value as gguf.ReaderField.contents() gives it) and `tensors`, as gguf.GGUFReader names them.
    The reader itself builds a numpy view per metadata array element: 4.6 s of a SmolLM2 conversion's
    CPU (a 49k-token vocabulary and its merges), half a minute for a 150k-token one."""

    def __init__(self, layout: GGUFLayout):
        self.path = layout.path
        self.fields = {key: MetaField(value) for key, value in layout.fields.items()}
        self.tensors = [GGUFTensor(layout.path, t.name, t.ggml_type, t.dims, t.offset, t.nbytes)
                        for t in layout.tensors]


class GGUFSource:
    """A GGUF file's tensors by name (a GGUFFile's or gguf.GGUFReader's), data by plain reads."""

    def __init__(self, path: Path, reader: Any):
        self.path = Path(path)
        self.tensors = {t.name: t for t in reader.tensors}

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(name)
        return None if t is None else tuple(int(x) for x in reversed(t.shape))   # GGUF lists dims inner first

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray | Blocks:
        from gguf import GGML_QUANT_SIZES, quants

        t = self.tensors[name]
        shape = self.shape(name)
        stop = shape[0] if stop is None else min(stop, shape[0])
        inner = int(np.prod(shape[1:], dtype=np.int64))
        block, type_bytes = GGML_QUANT_SIZES[t.tensor_type]
        row = inner // block * type_bytes
        with open(self.path, "rb") as f:
            raw = _read_at(f, int(t.data_offset) + start * row, (stop - start) * row).reshape(stop - start, row)
        kind = t.tensor_type.name
        if kind in ggml.TYPES and len(shape) == 2:
            return Blocks(kind, raw)
        try:
            w = quants.dequantize(raw, t.tensor_type)
        except NotImplementedError as exc:
            raise SourceError(f"tensor {name}: cannot dequantise type {kind}") from exc
        return np.asarray(w, np.float32).reshape(stop - start, *shape[1:])


def read_part(src: Any, name: str, part: int) -> np.ndarray | Blocks:
    """Slice `part` [out, in] of a 3-D [parts, out, in] tensor (an expert of llama.cpp's `_exps`
    tensors): one expert read, its blocks kept when we keep its type."""
    if isinstance(src, GGUFSource) and (kind := src.type_name(name)) in ggml.TYPES:
        from gguf import GGML_QUANT_SIZES

        shape, t = src.shape(name), src.tensors[name]
        block, type_bytes = GGML_QUANT_SIZES[t.tensor_type]
        row = shape[2] // block * type_bytes
        with open(src.path, "rb") as f:
            raw = _read_at(f, int(t.data_offset) + part * shape[1] * row, shape[1] * row)
        return Blocks(kind, raw.reshape(shape[1], row))
    return src.read(name, part, part + 1)[0]    # float (or another GGUF type, dequantised): that expert alone

