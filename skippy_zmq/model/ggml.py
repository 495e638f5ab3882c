"""GGUF (ggml) block types as data: a block layout and one dequantiser per type, and the runtime
tensor that keeps a matrix in its file's blocks.

Each dequantiser is written once over an array module `xp` (numpy or jax.numpy) and mirrors
gguf-py's `gguf.quants` float32 operations one for one (the same products and sums, in the same
order), so numpy, XLA and gguf-py give the same float32 values bit for bit
(tests/test_quant_ggml.py checks every type on random and edge-case blocks). Integer fields
are assembled byte by byte (little-endian, as GGUF stores them) rather than by a view, so the
same code traces under jit.

A BlockTensor is a matrix [out, in] held as its raw blocks [out, in / block, type bytes]; a
jitted step dequantises it (whole for a matmul, per gathered row for an embedding lookup).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from skippy_zmq.model.kernel import BLOCK_TARGET, kernel_available, kernel_isa

QK_K = 256
# GGML's type ids (ggml.h, gguf-py GGMLQuantizationType): what a checkpoint records per tensor.
TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
            "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}
TYPE_NAMES = {v: k for k, v in TYPE_IDS.items()}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclasses.dataclass(frozen=True)
class BlockType:
    name: str
    block: int        # weights per block
    nbytes: int       # bytes per block
    dequantize: Callable[[Any, Any], Any]   # (xp, uint8 [N, nbytes]) -> float32 [N, block]


# ---------------------------------------------------------------- fields


def _u16(xp: Any, b: Any) -> Any:
    """Little-endian uint16 from [..., 2] bytes."""
    return b[..., 0].astype(xp.uint16) | (b[..., 1].astype(xp.uint16) << xp.uint16(8))


def _u32(xp: Any, b: Any) -> Any:
    u = [b[..., i].astype(xp.uint32) << xp.uint32(8 * i) for i in range(4)]
    return u[0] | u[1] | u[2] | u[3]


def _bitcast(xp: Any, a: Any, dtype: Any) -> Any:
    return a.view(dtype) if xp is np else jax.lax.bitcast_convert_type(a, dtype)


def _f16(xp: Any, b: Any) -> Any:
    """float32 of a little-endian f16 field [N, 2] -> [N, 1]."""
    return _bitcast(xp, _u16(xp, b), xp.float16).astype(xp.float32)[:, None]


def _i8(xp: Any, a: Any) -> Any:
    return _bitcast(xp, a, xp.int8)


def _shifted(xp: Any, a: Any, shifts: tuple[int, ...], shape: tuple[int, ...], dtype: Any = None) -> Any:
    """a (reshaped to `shape`, whose third axis is 1) >> each of `shifts` along that axis."""
    dtype = dtype or xp.uint8
    return a.reshape(shape) >> xp.asarray(shifts, dtype).reshape(1, 1, len(shifts), 1)


def _nibbles(xp: Any, qs: Any, width: int) -> Any:
    """[N, k * width] bytes -> [N, k, 2, width] nibbles: low halves then high halves of each run of width."""
    n = qs.shape[0]
    return _shifted(xp, qs, (0, 4), (n, -1, 1, width)) & xp.uint8(0x0F)


# ---------------------------------------------------------------- float and 32-weight blocks


def _f32(xp: Any, b: Any) -> Any:
    return _bitcast(xp, _u32(xp, b.reshape(b.shape[0], -1, 4)), xp.float32)


def _f16_block(xp: Any, b: Any) -> Any:
    return _bitcast(xp, _u16(xp, b.reshape(b.shape[0], -1, 2)), xp.float16).astype(xp.float32)


def _bf16(xp: Any, b: Any) -> Any:
    return _bitcast(xp, _u16(xp, b.reshape(b.shape[0], -1, 2)).astype(xp.uint32) << xp.uint32(16), xp.float32)


def _q4_0(xp: Any, b: Any) -> Any:
    q = _nibbles(xp, b[:, 2:], 16).reshape(b.shape[0], -1)
    return _f16(xp, b[:, :2]) * (_i8(xp, q) - xp.int8(8)).astype(xp.float32)


def _q4_1(xp: Any, b: Any) -> Any:
    q = _nibbles(xp, b[:, 4:], 16).reshape(b.shape[0], -1).astype(xp.float32)
    return (_f16(xp, b[:, :2]) * q) + _f16(xp, b[:, 2:4])


def _q5(xp: Any, b: Any, head: int) -> Any:
    """Q5_0 / Q5_1 levels 0..31: the low nibbles, bit i of the u32 qh field as element i's fifth bit."""
    n = b.shape[0]
    qh = _u32(xp, b[:, head:head + 4])[:, None] >> xp.arange(32, dtype=xp.uint32)[None]
    ql = _nibbles(xp, b[:, head + 4:], 16).reshape(n, -1)
    return ql | ((qh & xp.uint32(1)).astype(xp.uint8) << xp.uint8(4))


def _q5_0(xp: Any, b: Any) -> Any:
    return _f16(xp, b[:, :2]) * (_i8(xp, _q5(xp, b, 2)) - xp.int8(16)).astype(xp.float32)


def _q5_1(xp: Any, b: Any) -> Any:
    return (_f16(xp, b[:, :2]) * _q5(xp, b, 4).astype(xp.float32)) + _f16(xp, b[:, 2:4])


def _q8_0(xp: Any, b: Any) -> Any:
    return _i8(xp, b[:, 2:]).astype(xp.float32) * _f16(xp, b[:, :2])


def _iq4_nl(xp: Any, b: Any) -> Any:
    q = _nibbles(xp, b[:, 2:], 16).reshape(b.shape[0], -1)
    return _f16(xp, b[:, :2]) * xp.asarray(IQ4_VALUES, xp.int8)[q.astype(xp.int32)].astype(xp.float32)


# ---------------------------------------------------------------- 256-weight (K) blocks


def _q2_k(xp: Any, b: Any) -> Any:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    dl = (_f16(xp, b[:, 80:82]) * (scales & xp.uint8(0xF)).astype(xp.float32)).reshape(n, 16, 1)
    ml = (_f16(xp, b[:, 82:84]) * (scales >> xp.uint8(4)).astype(xp.float32)).reshape(n, 16, 1)
    q = (_shifted(xp, qs, (0, 2, 4, 6), (n, -1, 1, 32)) & xp.uint8(3)).reshape(n, 16, 16).astype(xp.float32)
    return (dl * q - ml).reshape(n, -1)


def _q3_k(xp: Any, b: Any) -> Any:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    lo = (scales[:, :8].reshape(n, 1, 8) >> xp.asarray((0, 4), xp.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (scales[:, 8:].reshape(n, 1, 4) >> xp.asarray((0, 2, 4, 6), xp.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = (lo & xp.uint8(0x0F)) | ((hi & xp.uint8(0x03)) << xp.uint8(4))
    dl = (_f16(xp, b[:, 108:110]) * (_i8(xp, sc) - xp.int8(32)).astype(xp.float32)).reshape(n, 16, 1)
    ql = _shifted(xp, qs, (0, 2, 4, 6), (n, -1, 1, 32)).reshape(n, 16, 16) & xp.uint8(3)
    qh = (_shifted(xp, hmask, tuple(range(8)), (n, -1, 1, 32)).reshape(n, 16, 16) & xp.uint8(1)) ^ xp.uint8(1)
    q = (_i8(xp, ql) - _i8(xp, qh << xp.uint8(2))).astype(xp.float32)
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(xp: Any, scales: Any) -> tuple[Any, Any]:
    """Q4_K / Q5_K's eight 6-bit scales and mins, packed in 12 bytes (gguf-py Q4_K.get_scale_min)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = xp.concatenate([d & xp.uint8(0x3F), (md & xp.uint8(0x0F)) | ((d >> xp.uint8(2)) & xp.uint8(0x30))], axis=-1)
    mn = xp.concatenate([m & xp.uint8(0x3F), (md >> xp.uint8(4)) | ((m >> xp.uint8(2)) & xp.uint8(0x30))], axis=-1)
    return sc, mn


def _k4_scales(xp: Any, b: Any) -> tuple[Any, Any]:
    n = b.shape[0]
    sc, mn = _scale_min_k4(xp, b[:, 4:16])
    d = (_f16(xp, b[:, :2]) * sc.astype(xp.float32)).reshape(n, -1, 1)
    dm = (_f16(xp, b[:, 2:4]) * mn.astype(xp.float32)).reshape(n, -1, 1)
    return d, dm


def _q4_k(xp: Any, b: Any) -> Any:
    n = b.shape[0]
    d, dm = _k4_scales(xp, b)
    q = _nibbles(xp, b[:, 16:], 32).reshape(n, -1, 32).astype(xp.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(xp: Any, b: Any) -> Any:
    n = b.shape[0]
    d, dm = _k4_scales(xp, b)
    ql = _nibbles(xp, b[:, 48:], 32).reshape(n, -1, 32)
    qh = (_shifted(xp, b[:, 16:48], tuple(range(8)), (n, -1, 1, 32)) & xp.uint8(1)).reshape(n, -1, 32)
    q = (ql | (qh << xp.uint8(4))).astype(xp.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(xp: Any, b: Any) -> Any:
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = (_f16(xp, b[:, 208:210]) * _i8(xp, scales).astype(xp.float32)).reshape(n, 16, 1)
    lo = _nibbles(xp, ql, 64).reshape(n, -1, 32)
    hi = (_shifted(xp, qh, (0, 2, 4, 6), (n, -1, 1, 32)) & xp.uint8(0x03)).reshape(n, -1, 32)
    q = (_i8(xp, lo | (hi << xp.uint8(4))) - xp.int8(32)).reshape(n, 16, -1).astype(xp.float32)
    return (d * q).reshape(n, QK_K)


def _iq4_xs(xp: Any, b: Any) -> Any:
    n = b.shape[0]
    sh = _u16(xp, b[:, 2:4])[:, None] >> xp.asarray([2 * i for i in range(8)], xp.uint16)[None]
    sl = (b[:, 4:8].reshape(n, -1, 1) >> xp.asarray((0, 4), xp.uint8).reshape(1, 1, 2)).reshape(n, -1) & xp.uint8(0x0F)
    sc = _i8(xp, sl | ((sh.astype(xp.uint8) & xp.uint8(0x03)) << xp.uint8(4))) - xp.int8(32)
    dl = (_f16(xp, b[:, :2]) * sc.astype(xp.float32)).reshape(n, -1, 1)
    q = _nibbles(xp, b[:, 8:], 16).reshape(n, -1, 32)
    values = xp.asarray(IQ4_VALUES, xp.int8)[q.astype(xp.int32)].astype(xp.float32)
    return (dl * values).reshape(n, -1)


TYPES = {t.name: t for t in (
    BlockType("F32", 1, 4, _f32), BlockType("F16", 1, 2, _f16_block), BlockType("BF16", 1, 2, _bf16),
    BlockType("Q4_0", 32, 18, _q4_0), BlockType("Q4_1", 32, 20, _q4_1), BlockType("Q5_0", 32, 22, _q5_0),
    BlockType("Q5_1", 32, 24, _q5_1), BlockType("Q8_0", 32, 34, _q8_0), BlockType("Q2_K", QK_K, 84, _q2_k),
    BlockType("Q3_K", QK_K, 110, _q3_k), BlockType("Q4_K", QK_K, 144, _q4_k), BlockType("Q5_K", QK_K, 176, _q5_k),
    BlockType("Q6_K", QK_K, 210, _q6_k), BlockType("IQ4_NL", 32, 18, _iq4_nl), BlockType("IQ4_XS", QK_K, 136, _iq4_xs))}
KERNEL_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}   # types the CPU kernel runs as QTensors (bits), levels exact
# Types the CPU kernel reads in place as the file's blocks (block_kernel_isa.cc; the last five unpacked by
# block_kernel_more_isa.cc). Q8_0 matrices run as QTensors (KERNEL_TYPES), a tied head too (the lookup gathers
# its columns: one copy); the kernel reads Q8_0 blocks where something keeps them as blocks.
BLOCK_KERNEL_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0", "Q3_K", "IQ4_XS", "IQ4_NL", "Q5_1", "Q2_K")
# The ones SKIPPY_KERNEL_ISA=avx512vnni (opt-in) runs on int8 activations, as quant_kernel.h's
# skippy_int8_block_type lists them (tests/test_block_kernel.py holds the two to the same list).
INT8_BLOCK_TYPES = ("Q4_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "Q8_0", "Q5_K", "Q5_1", "Q5_0")
# The ones SKIPPY_KERNEL_ISA=avx2int8 (opt-in) runs on int8 activations (skippy_int8_block_type_avx2): a
# Q4_K_M / Q5_K_M / Q6_K file's types; the rest keep the float loops there.
INT8_BLOCK_TYPES_AVX2 = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0")
INT8_TYPES_BY_ISA = {"avx512vnni": INT8_BLOCK_TYPES, "avx2int8": INT8_BLOCK_TYPES_AVX2}
# Types a CPU stage repacks at load, losslessly, into the kernel's column panels (quant.QTensor of these bits),
# where the kernel would otherwise read them as blocks: Q5_0's rows took ~2x the panel loops' time a weight
# (a scale per 16 inputs against one per 32 shared by 64 columns), the bulk of SmolLM2 Q4_K_M's decode step.
PANEL_TYPES = {"Q5_0": 5}
# Where a matrix of any other type is dequantised (docs/models.md): "load" once, to float32, when the stage
# loads; "step" inside every jitted step; "auto" (unset): on a CPU the kernel reads BLOCK_KERNEL_TYPES in
# place and the rest are dequantised at load (the in-step dequantiser made SmolLM2 Q4_K_M decode 9x slower
# than the same file in f32); "step" on GPU / TPU. "load" dequantises every type but KERNEL_TYPES.
DEQUANTISE_ENV = "SKIPPY_GGUF_DEQUANTISE"
DEQUANTISE_CHOICES = ("auto", "load", "step")


def block_type(name: str) -> BlockType:
    """The kept type `name`; a ValueError names the ones we keep."""
    if name not in TYPES:
        raise ValueError(f"GGUF type {name} is not one we keep as it is (kept: {', '.join(TYPES)})")
    return TYPES[name]


def _dequantise_choice() -> str:
    choice = os.environ.get(DEQUANTISE_ENV, "auto").strip().lower() or "auto"
    if choice not in DEQUANTISE_CHOICES:
        raise ValueError(f"{DEQUANTISE_ENV}={choice!r}: expected one of {', '.join(DEQUANTISE_CHOICES)}")
    return choice


def dequantise_at_load(platform: str) -> bool:
    """Whether a stage on `platform` ("cpu", "gpu", "tpu"; a device spelling "gpu:0" is fine) dequantises
    its matrices of types without a CPU kernel once at load, from DEQUANTISE_ENV (above)."""
    choice = _dequantise_choice()
    return choice == "load" or (choice == "auto" and platform.split(":")[0] == "cpu")


def kernel_block_types(platform: str) -> tuple[str, ...]:
    """The types whose matrices a stage on `platform` keeps as blocks for the CPU kernel to read in place
    (BLOCK_KERNEL_TYPES on a CPU under "auto" when the kernel is built; none otherwise)."""
    if _dequantise_choice() != "auto" or platform.split(":")[0] != "cpu" or not kernel_available():
        return ()
    return BLOCK_KERNEL_TYPES


def int8_block_kinds() -> tuple[str, ...]:
    """The types a CPU stage keeps as the file's blocks where it would otherwise pack them (Q8_0,
    KERNEL_TYPES) or repack them into panels (Q5_0, PANEL_TYPES): under SKIPPY_KERNEL_ISA=avx2int8 the ones
    its block loops run on int8 activations (INT8_BLOCK_TYPES_AVX2), its panel loops being float; none
    elsewhere."""
    return INT8_BLOCK_TYPES_AVX2 if kernel_isa() == "avx2int8" else ()


def row_bytes(name: str, n: int) -> int:
    """Bytes of one row of n weights in type `name` (n a multiple of its block)."""
    t = block_type(name)
    if n % t.block:
        raise ValueError(f"a {name} row needs a multiple of {t.block} weights, got {n}")
    return n // t.block * t.nbytes


def dequantize(blocks: Any, name: str, xp: Any = np) -> Any:
    """Rows of raw blocks [..., bytes] (uint8) -> float32 [..., weights], gguf-py's values bit for bit."""
    t = block_type(name)
    lead, nbytes = blocks.shape[:-1], blocks.shape[-1]
    flat = blocks.reshape(-1, t.nbytes)
    return t.dequantize(xp, flat).reshape(*lead, nbytes // t.nbytes * t.block)


def q5_0_levels(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of Q5_0 blocks [rows, bytes] -> levels uint8 0..31 [rows, weights] and d float16 [rows, blocks]:
    w = d * (level - 16), gguf-py's values exactly (_q5_0 is d times those levels less 16)."""
    rows = blocks.shape[0]
    b = np.asarray(blocks, np.uint8).reshape(rows, -1, 22)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]
    levels = _q5(np, b.reshape(-1, 22), 2)
    return levels.reshape(rows, -1), d


# ---------------------------------------------------------------- runtime


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockTensor:
    """A matrix [out, in] kept in its GGUF blocks: `blocks` uint8 [out, in / block * type bytes].
    `kind` (the type name) is static, part of the jit cache key."""

    blocks: Any
    kind: str = dataclasses.field(metadata=dict(static=True))
    impl: str = dataclasses.field(default="xla", metadata=dict(static=True))   # "kernel": block_kernel_isa.cc

    @property
    def shape(self) -> tuple[int, int]:
        t = TYPES[self.kind]
        return (self.blocks.shape[-2], self.blocks.shape[-1] // t.nbytes * t.block)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


def block_dense(x: jax.Array, w: BlockTensor) -> jax.Array:
    """x @ W.T for W [out, in] in blocks: the CPU kernel reading them in place (impl "kernel"), else
    dequantised inside the step, then one f32 dot."""
    if w.impl == "kernel" and w.blocks.ndim == 2 and kernel_available():
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        out = jax.ShapeDtypeStruct((x2.shape[0], w.blocks.shape[0]), jnp.float32)
        y = jax.ffi.ffi_call(BLOCK_TARGET, out)(x2, w.blocks, type=np.int64(TYPE_IDS[w.kind]))
        return y.reshape(*lead, w.blocks.shape[0]).astype(x.dtype)
    weight = dequantize(w.blocks, w.kind, jnp)
    y = jax.lax.dot_general(x.astype(jnp.float32), weight, (((x.ndim - 1,), (weight.ndim - 1,)), ((), ())))
    return y.astype(x.dtype)


def block_rows(table: BlockTensor, ids: jax.Array) -> jax.Array:
    """table[ids] as float32 rows: only the gathered rows are dequantised."""
    return dequantize(table.blocks[ids], table.kind, jnp)
