"""Storage formats of a matrix in a checkpoint, and the bytes each costs on disk and at run time.

Every matrix is [out, in] (PyTorch and GGUF order); the group of 32 runs along
`in`, the direction of GGUF's blocks. A matrix in format

    f32   {"w": float32 [out, in]}
    bf16  {"w": bfloat16 [out, in]}
    int8  {"q": int8 [out, in],       "d": f16 [out, in/32], "m": f16 [out, in/32]}  1.125 B/weight
    q4    {"q": uint8 [out, in/2],    "d": f16 [out, in/32], "m": f16 [out, in/32]}  0.625 B/weight
    gguf  {"blocks": uint8 [out, row bytes], "ggml_type": int32 []}                the file's own blocks

stands for w = q * d + m per group (one group when 32 does not divide `in`);
q4 byte j of a row holds input 2j in its low nibble and 2j + 1 in its high one.
Quantising uses quant.py's grids, the very functions a stage quantises with at
load, so the levels are the same; only d and m are rounded to f16.

"gguf" keeps each GGUF tensor in its own type (model/ggml.py: Q4_0 ... Q6_K, IQ4_*, F16, BF16,
F32) as its raw block bytes, `ggml_type` GGML's type id; it is the finest format, as its values
are the file's exactly: a stage runs it as stored, or dequantises (and requantises) it at load.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from skippy_zmq.model import ggml, quant

KEEP = "gguf"                                # the file's own block types (a GGUF's default)
FORMATS = (KEEP, "f32", "bf16", "int8", "q4")   # finest first: a stage may run its checkpoint's format or a later one
GROUP = quant.GROUP_SIZE                     # 32 inputs per scale and offset
QUANT_CHUNK_ROWS = 1024                      # output rows quantised at once (bounds the temporaries)


class CheckpointError(ValueError):
    """The checkpoint cannot serve the request; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A weight already in a quantised grid: w[o, i] = q[o, i] * d[o, g] + m[o, g], g = i // 32.

    fmt "q4": q uint8 levels 0..15 [out, in] (unpacked); "int8": q int8 [out, in].
    d and m float16 [out, groups]. Make one with `q4_blocks` / `int8_blocks`.
    """

    fmt: str
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A matrix [out, in] as a GGUF type's raw blocks: `raw` uint8 [out, in / block * type bytes]
    (model/ggml.py). Whole rows of blocks, so row permutations and row slices are exact."""

    kind: str
    raw: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        t = ggml.block_type(self.kind)
        return (self.raw.shape[0], self.raw.shape[1] // t.nbytes * t.block)

    def rows(self, start: int, n: int) -> Blocks:
        return Blocks(self.kind, self.raw[start:start + n])


def q4_blocks(levels: np.ndarray, d: np.ndarray, m: np.ndarray) -> Encoded:
    """Exact Q4_1-style blocks: levels uint8 0..15 [out, in], d and m f16 [out, in/32]; w = q * d + m.
    (Q4_0's w = (q - 8) * d is d, m = -8 * d.)"""
    return Encoded("q4", np.asarray(levels, np.uint8), np.asarray(d, np.float16), np.asarray(m, np.float16))


def int8_blocks(levels: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> Encoded:
    """Exact int8 blocks (Q8_0: m = 0): levels int8 [out, in], d (and m) f16 [out, in/32]."""
    d = np.asarray(d, np.float16)
    return Encoded("int8", np.asarray(levels, np.int8), d, np.zeros_like(d) if m is None else np.asarray(m, np.float16))


# ---------------------------------------------------------------- formats


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise CheckpointError(f"weights format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def stored_format(fmt: str, key: str) -> str:
    """The format `key` ("embed", "head" or a layer key) is stored in by a checkpoint of `fmt`: an MoE
    router (and a shared expert's gate) stays f32 in every format, as it computes in f32."""
    if key in ("router", "shared_gate"):     # weights.ROUTER_KEYS (weights imports this module's users)
        return "f32"
    return "int8" if fmt == "q4" and key in ("embed", "head") else fmt


def encode(w: np.ndarray | Encoded | Blocks, fmt: str) -> dict[str, np.ndarray]:
    """One [out, in] matrix (float, an Encoded grid or GGUF Blocks) -> its stored arrays in `fmt`.
    Blocks keep their bytes under "gguf"; Q4_0 / Q4_1 / Q8_0 keep their levels under int8 / q4; any
    other type is dequantised (gguf-py's values) and, for int8 / q4, requantised."""
    if isinstance(w, Blocks):
        if fmt == KEEP:
            return {"blocks": np.ascontiguousarray(w.raw), "ggml_type": np.int32(ggml.TYPE_IDS[w.kind])}
        if w.kind in ggml.KERNEL_TYPES:
            return _encode_grid(parse_blocks(w.raw, w.kind), fmt)
        return encode(ggml.dequantize(w.raw, w.kind), fmt)
    if fmt == KEEP:     # a float (or grid) matrix in a gguf checkpoint: its values exactly, as F32
        w = dequantize_grid(w) if isinstance(w, Encoded) else w
        return encode(Blocks("F32", np.ascontiguousarray(np.asarray(w, np.float32)).view(np.uint8)), KEEP)
    if isinstance(w, Encoded):
        return _encode_grid(w, fmt)
    if fmt in ("f32", "bf16"):
        return {"w": np.asarray(w, np.float32 if fmt == "f32" else ml_dtypes.bfloat16)}
    rows = [_quantise_rows(np.asarray(w[r:r + QUANT_CHUNK_ROWS], np.float32), fmt)
            for r in range(0, w.shape[0], QUANT_CHUNK_ROWS)]
    return _stored(fmt, *(np.concatenate(part) for part in zip(*rows)))


def _quantise_rows(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # quant.py's grids on [in, out], the very functions a stage quantises with at load.
    group = GROUP if w.shape[1] % GROUP == 0 else None
    r = quant.quantize_q4(w.T, group) if fmt == "q4" else quant.quantize_int8(w.T, group)
    s, z = (r["s"][None], r["z"][None]) if group is None else (r["s"], r["z"])
    return r["q"].T, s.T.astype(np.float16), z.T.astype(np.float16)


def _encode_grid(e: Encoded, fmt: str) -> dict[str, np.ndarray]:
    if e.fmt == fmt:
        return _stored(fmt, e.q, e.d, e.m)
    if e.fmt == "q4" and fmt == "int8":        # 0..15 levels are int8 levels: exact
        return _stored(fmt, e.q.astype(np.int8), e.d, e.m)
    return encode(dequantize_grid(e), fmt)     # finer float, or int8 -> q4: requantise


def _stored(fmt: str, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> dict[str, np.ndarray]:
    if fmt == "q4":
        if q.shape[1] % 2:
            raise CheckpointError(f"q4 needs an even input width, got {q.shape[1]}")
        q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return {"q": np.ascontiguousarray(q), "d": np.asarray(d, np.float16), "m": np.asarray(m, np.float16)}


def grid(stored: dict[str, np.ndarray]) -> Encoded:
    """Stored int8 / q4 arrays -> unpacked levels and f16 scales."""
    q = stored["q"]
    if q.dtype == np.uint8:
        q = np.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], -1)
        return Encoded("q4", q, stored["d"], stored["m"])
    return Encoded("int8", q, stored["d"], stored["m"])


def dequantize_grid(e: Encoded) -> np.ndarray:
    out, n = e.q.shape
    g = e.d.shape[1]
    w = e.q.reshape(out, g, n // g).astype(np.float32) * e.d[:, :, None].astype(np.float32)
    return (w + e.m[:, :, None].astype(np.float32)).reshape(out, n)


def to_float(stored: dict[str, np.ndarray]) -> np.ndarray:
    """Any stored matrix -> float32 [out, in]."""
    if "blocks" in stored:
        return ggml.dequantize(np.asarray(stored["blocks"]), stored_type(stored))
    return np.asarray(stored["w"], np.float32) if "w" in stored else dequantize_grid(grid(stored))


def stored_type(stored: dict[str, np.ndarray]) -> str:
    """The GGUF type name of a matrix stored "gguf"."""
    kind = ggml.TYPE_NAMES.get(int(stored["ggml_type"]))
    if kind is None:
        raise CheckpointError(f"stored GGUF type id {int(stored['ggml_type'])} is not one this runtime keeps")
    return kind


def parse_blocks(raw: np.ndarray, kind: str) -> Encoded:
    """Rows of raw Q4_0 / Q4_1 / Q8_0 blocks [rows, bytes] -> exact levels and f16 scales.

    Q4_0: f16 d, 16 bytes of nibbles, w = (q - 8) d (stored as m = -8 d);
    Q4_1: f16 d, f16 m, 16 bytes, w = q d + m; Q8_0: f16 d, 32 int8, w = q d.
    Nibbles (as gguf.quants): byte j holds element j (low) and j + 16 (high).
    """
    rows = raw.shape[0]
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[kind]
    blocks = raw.reshape(rows, -1, head + (GROUP if kind == "Q8_0" else GROUP // 2))
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    body = blocks[..., head:]
    if kind == "Q8_0":
        return int8_blocks(np.ascontiguousarray(body).view(np.int8).reshape(rows, -1), d)
    levels = np.concatenate([body & 15, body >> 4], axis=-1).reshape(rows, -1)
    if kind == "Q4_1":
        return q4_blocks(levels, d, np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0])
    return q4_blocks(levels, d, (d.astype(np.float32) * -8.0).astype(np.float16))


def stored_nbytes(shape: tuple[int, int], fmt: str) -> int:
    """Bytes an [out, in] matrix takes on disk in `fmt` (before orbax's compression); gguf: kept_nbytes."""
    if fmt == KEEP:
        raise CheckpointError("a gguf matrix's bytes depend on its GGUF type: use kept_nbytes")
    out, n = shape
    groups = n // GROUP if n % GROUP == 0 else 1
    return {"f32": 4 * out * n, "bf16": 2 * out * n, "int8": out * n + 4 * out * groups,
            "q4": out * n // 2 + 4 * out * groups}[check_format(fmt)]


def runtime_nbytes(shape: tuple[int, int], fmt: str, key: str = "", stored: str | None = None,
                   dtype: str = "float32") -> int:
    """Exact bytes an [out, in] matrix takes in a stage's memory when the stage runs `fmt`
    from a checkpoint stored in `stored` (default: `fmt`); `dtype` is the stage's float dtype.

    key: a layer key, "head" (int8 under q4, as GGUF Q4 files keep it) or "embed"
    (the first stage's lookup table: int8 rows + f16 scales when stored quantised).
    QTensors count their 64-column panel padding and f16 scale and offset per 32.
    """
    if fmt == KEEP:
        raise CheckpointError("a gguf matrix's bytes depend on its GGUF type: use kept_nbytes")
    out, n = shape
    stored = check_format(stored or fmt)
    groups = n // GROUP if n % GROUP == 0 else 1
    if fmt == "bf16":                                             # matrices and the embedding in bf16
        return 2 * out * n
    if fmt == "f32" or (key == "embed" and stored in (KEEP, "f32", "bf16")):
        return np.dtype(dtype).itemsize * out * n
    if key == "embed":
        return out * n + 2 * 2 * out * groups                     # quant.QRows
    return _qtensor_nbytes(out, n, 4 if fmt == "q4" and key != "head" else 8)


def _qtensor_nbytes(out: int, n: int, bits: int, offsets: bool = True) -> int:
    groups = n // GROUP if n % GROUP == 0 else 1
    padded = -(-out // quant.PANEL) * quant.PANEL
    scales = 2 if offsets and bits != 5 else 1                     # (none stored: quant.offsets)
    return padded * n * bits // 8 + 2 * scales * padded * groups   # levels + f16 s and z


def kept_nbytes(shape: tuple[int, int], kind: str, key: str = "", at_load: bool = False,
                packed: bool = False) -> int:
    """Exact bytes an [out, in] matrix of GGUF type `kind` takes in a stage running "gguf": its blocks
    (model/ggml.BlockTensor), or for Q4_0 / Q4_1 / Q8_0 matrices the CPU kernel's packed levels
    (QTensor; the embedding stays blocks, gathered per row); `packed` (a CPU stage: KeptTypes.packed):
    a ggml.PANEL_TYPES matrix repacked into panels; `at_load` (ggml.dequantise_at_load): any other
    type's matrix is float32, dequantised once at load."""
    out, n = shape
    if kind in ggml.KERNEL_TYPES and key != "embed":
        return _qtensor_nbytes(out, n, ggml.KERNEL_TYPES[kind], kind != "Q8_0")
    if packed and kind in ggml.PANEL_TYPES and key != "embed":
        return _qtensor_nbytes(out, n, ggml.PANEL_TYPES[kind])
    if at_load and key != "embed":
        ggml.row_bytes(kind, n)       # the same check on the row's width
        return 4 * out * n
    return out * ggml.row_bytes(kind, n)
