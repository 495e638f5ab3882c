"""Weight-only int8 and 4-bit weights: levels in memory, float16 scale and
offset per group of 32 inputs.

Decode on CPU is memory-bound (every weight is read once per token), so
reading 1 byte (int8) or half a byte (q4) per weight instead of 4 is the whole
point. XLA CPU cannot do that by itself: measured on this repo's CPU, every
XLA formulation of an int8 matmul (convert then dot, dot_general with
preferred_element_type, int8 x int8 -> int32 with dynamic activation scales,
convert-multiply-reduce) materialises the widened weight and runs 10-20x
slower than the f32 dot. So on CPU the QTensor matmul is a small native kernel
(quant_kernel*.cc, through the XLA FFI) that widens levels in registers;
elsewhere, or without a C++ compiler, it falls back to the correct but slow
XLA dequantise-then-dot. docs/models.md ("The native kernel") says how it is built and
dispatched.

Each group of 32 input rows of a column gets W ~= q * s + z, whichever of two
grids reconstructs it better: int8 takes a symmetric grid (z = 0) or a min/max
grid; q4 (levels 0..15) takes Q4_1's min/max grid or Q4_0's symmetric one.
Why: a per-column scale moved logits by up to ~2 (mean 0.23), far above the
~0.04 top-1/top-2 margins of the parity prompts; groups of 32 match how GGUF
files quantise, and the grids contain those blocks' levels exactly (int8:
Q4_1 and Q8_0; q4: Q4_1 and Q4_0), so weights converted from such a file are
reproduced exactly (q4: the very same levels).

Scales and offsets are float16, as GGUF blocks store d and m: 2 bytes each per
32 weights (q4: 0.625 B/weight, int8: 1.125), where float32 cost 0.75 / 1.25,
and decode reads every byte once per token. A grid's s and z are rounded to
float16 before its levels are chosen, so the levels are the best ones for the
scales actually held; GGUF's f16 d and m (Q4_0: s = d, z = -8 d, a power-of-two
multiple) are float16 values already and come through unchanged.

Weights are packed for the kernel as 64-column panels (Np = out rounded up to
64, padding columns are zero): q int8 [Np / 64, K, 64] or, for q4, uint8
[Np / 64, K, 32] with column j in the low nibble of byte j and column j + 32
in the high nibble; s and z float16 [Np / 64, groups, 64]. Bits 5 (GGUF Q5_0's
levels 0..31, repacked at load: pack_rows) is q4's 32 bytes then 8 more, bit j
of those 64 the fifth bit of column j: uint8 [Np / 64, K, 40]; its offset is
always -16 s (Q5_0's w = d * (level - 16)), so z is empty [Np / 64, 0, 64].
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from skippy_zmq.model import ggml
# the kernel's build and loading live in model/kernel.py; its names stay reachable here for callers
from skippy_zmq.model.kernel import (ATTEND_TARGET, CACHE_ENV, CXX_FLAGS, ISA_ENV, ISA_FLAGS, KERNEL_DIR,  # noqa: F401
                                     KERNEL_SOURCES, KERNEL_TARGETS, MOE_TARGETS, _kernel_path, kernel_available,
                                     kernel_cache_dir, kernel_isa, kernel_isas, supported_isas)

PANEL = 64
GROUP_SIZE = 32   # input rows per scale; to_qtensor falls back to one group when it does not divide
ATTENTION_ENV = "SKIPPY_DECODE_ATTENTION"   # kernel (default) | xla: which decode attention a CPU step runs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantised [in, out] weight packed in panels: W[k, n] = q[k, n] * s[g, n] + z[g, n]
    with g = k // (in / groups).

    `n` (the logical out width), `impl` ("kernel" | "xla") and `bits` (8 or 4)
    are static, so they are part of the jit cache key, never traced.
    """

    q: Any   # int8 [Np / 64, in, 64] (bits 8), uint8 [Np / 64, in, 32] (bits 4) or [.., 40] (bits 5)
    s: Any   # float16 [Np / 64, groups, 64]
    # float16 [Np / 64, groups, 64]; None where none are stored (bits 5, GGUF Q8_0: `offsets`): no leaf,
    # so a step's dispatch checks no empty array (181 of a SmolLM2 Q4_K_M step's 637 leaves were one)
    z: Any
    n: int = dataclasses.field(metadata=dict(static=True))
    impl: str = dataclasses.field(default="kernel", metadata=dict(static=True))
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))   # 8, 4 or 5

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[1], self.n)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes + (0 if self.z is None else self.z.nbytes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QRows:
    """An embedding kept as its int8 levels: row r = q[r] * s[r, g] + z[r, g] per `in / groups`
    columns (s and z float16, as stored). A lookup widens only the rows it gathers, so a
    first stage holds 1.125 B/weight of embedding instead of 4."""

    q: Any   # int8 [V, D]
    s: Any   # float16 [V, groups]
    z: Any   # float16 [V, groups]


def embed_rows(table: Any, ids: jax.Array) -> jax.Array:
    """table[ids] as float32 rows, for a plain [V, D] array, a QRows, GGUF blocks (ggml.BlockTensor) or
    a tied head's QTensor [D, V] (its columns: one packed copy serves the head and the lookup)."""
    if isinstance(table, ggml.BlockTensor):
        return ggml.block_rows(table, ids)
    if isinstance(table, QTensor):
        return qtensor_rows(table, ids)
    if not isinstance(table, QRows):
        return table[ids]
    groups = table.s.shape[-1]
    q = table.q[ids].astype(jnp.float32).reshape(*ids.shape, groups, -1)
    s, z = table.s[ids].astype(jnp.float32), table.z[ids].astype(jnp.float32)
    return (q * s[..., None] + z[..., None]).reshape(*ids.shape, -1)


def qtensor_rows(t: QTensor, ids: jax.Array) -> jax.Array:
    """Columns `ids` of a QTensor [in, out] as float32 rows [..., in]: q * s + z per weight, the values
    `dequantize` gives (a tied head's lookup reads only the panels' columns it gathers)."""
    p, c = ids // PANEL, ids % PANEL
    groups = t.s.shape[1]
    if t.bits == 8:
        q = t.q[p, :, c]                                                   # [..., in]
    else:    # byte c % 32 of a q4 panel row holds column c (low nibble) or c + 32 (high)
        q = (t.q[p, :, c % (PANEL // 2)] >> (4 * (c >= PANEL // 2)).astype(jnp.uint8)[..., None]) & 15
        if t.bits == 5:   # bit c % 8 of byte 32 + c // 8: the fifth bit
            q = q | (((t.q[p, :, PANEL // 2 + c // 8] >> (c % 8).astype(jnp.uint8)[..., None]) & 1) << 4)
    s, z = t.s[p, :, c].astype(jnp.float32), offsets(t.s, t.z, t.bits)[p, :, c]   # [..., groups]
    q = q.astype(jnp.float32).reshape(*ids.shape, groups, -1)
    return (q * s[..., None] + z[..., None]).reshape(*ids.shape, -1)


def quantize_int8(w: np.ndarray, group_size: int | None = None,
                  offsets: bool = True) -> dict[str, np.ndarray]:
    """int8 weights: w[k, j] ~= q[k, j] * s[g, j] + z[g, j], g = k // group_size.

    group_size None: one group (per output channel; s and z are then [out]).
    offsets False: symmetric only (z = 0). Otherwise each (group, column)
    takes whichever of the symmetric, min/max or Q4_1 (16-level min/max) grid
    has the smaller max error.
    """
    w3, lo, hi = _groups(w, group_size)
    best = _grid(w3, np.maximum(-lo, hi) / 127.0, np.zeros_like(lo), -128, 127)   # symmetric (Q8_0)
    if offsets:
        step = (hi - lo) / 255.0                                                    # q = -128 at the min
        best = _pick(best, _grid(w3, step, lo + 128.0 * step, -128, 127))
        # Q4_1's grid in levels 0..15: lo + 128 * step is no float16 value, so without it
        # a Q4_1 block would come through only to a step's rounding, not exactly.
        best = _pick(best, _grid(w3, (hi - lo) / 15.0, lo, 0, 15))
    return _result(best, w.shape, group_size, np.int8)


def quantize_q4(w: np.ndarray, group_size: int | None = GROUP_SIZE) -> dict[str, np.ndarray]:
    """4-bit levels 0..15: w[k, j] ~= q[k, j] * s[g, j] + z[g, j], g = k // group_size.

    Each (group, column) takes whichever of Q4_1's grid (s = (max - min) / 15,
    z = min) or Q4_0's (s = -v / 8, z = v, v the value of largest magnitude)
    has the smaller max error, so blocks of either GGUF type keep their levels.
    """
    w3, lo, hi = _groups(w, group_size)
    best = _grid(w3, (hi - lo) / 15.0, lo, 0, 15)                                  # Q4_1
    at = np.abs(w3).argmax(axis=1)[:, None]
    big = np.take_along_axis(w3, at, axis=1)[:, 0]                                  # signed absmax
    best = _pick(best, _grid(w3, big / -8.0, big, 0, 15))                           # Q4_0: (q - 8) * d
    return _result(best, w.shape, group_size, np.uint8)


def _groups(w: np.ndarray, group_size: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = np.asarray(w, np.float32)
    k, n = w.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"group_size {g} does not divide the input width {k}")
    w3 = w.reshape(k // g, g, n)
    return w3, w3.min(axis=1), w3.max(axis=1)


def _grid(w3: np.ndarray, s: np.ndarray, z: np.ndarray, qmin: int, qmax: int) -> tuple[np.ndarray, ...]:
    """Round onto q * s + z, s and z rounded to float16 first (what is held);
    returns (q, s, z, max error per group and column)."""
    s, z = _f16_step(s), _f16(z)
    safe = np.where(s != 0, s, 1.0)                                                 # constant groups: q = 0
    q = np.clip(np.rint((w3 - z[:, None]) / safe[:, None]), qmin, qmax)
    err = np.abs(q * s[:, None] + z[:, None] - w3).max(axis=1)
    return q, s, z, err


def _f16(a: np.ndarray) -> np.ndarray:
    """float32 values float16 can hold (overflow to +-inf is left to the caller's data)."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _f16_step(s: np.ndarray) -> np.ndarray:
    """A grid step as float16: the nearest, or one ulp larger where the nearest is
    smaller by more than float32 rounding (the grid must still span its group; a
    step that is already a float16 value, as GGUF's d, stays exactly itself)."""
    s = np.asarray(s, np.float32)
    near = s.astype(np.float16)
    short = np.abs(near.astype(np.float32)) < np.abs(s) * (1 - 2.0 ** -20)
    bumped = np.nextafter(near, np.copysign(np.float16(np.inf), near))
    return np.where(short, bumped, near).astype(np.float32)


def _pick(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    take_b = b[3] < a[3]
    return (np.where(take_b[:, None], b[0], a[0]), np.where(take_b, b[1], a[1]),
            np.where(take_b, b[2], a[2]), np.minimum(a[3], b[3]))


def _result(best: tuple[np.ndarray, ...], shape: tuple[int, int], group_size: int | None,
            dtype: Any) -> dict[str, np.ndarray]:
    q, s, z, _ = best
    if group_size is None:
        s, z = s[0], z[0]
    return {"q": q.astype(dtype).reshape(shape), "s": s.astype(np.float32), "z": z.astype(np.float32)}


def pack(q: np.ndarray, s: np.ndarray, z: np.ndarray | None = None, impl: str = "kernel",
         bits: int = 8) -> QTensor:
    """[in, out] levels (int8, or uint8 0..15 for bits 4) + [out] or [groups, out]
    scales (and offsets) -> 64-column panels."""
    k, n = q.shape
    np_ = -(-n // PANEL) * PANEL
    padded = np.zeros((k, np_), np.int8 if bits == 8 else np.uint8)
    padded[:, :n] = q
    panels = padded.reshape(k, np_ // PANEL, PANEL).transpose(1, 0, 2)
    if bits == 4:
        if padded.max(initial=0) > 15:
            raise ValueError("4-bit levels must lie in 0..15")
        panels = panels[..., :PANEL // 2] | (panels[..., PANEL // 2:] << 4)
    elif bits != 8:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    z = np.zeros_like(s) if z is None else z

    def pack_scales(a: np.ndarray) -> np.ndarray:   # [groups, out] -> [Np / 64, groups, 64]
        a = np.pad(np.asarray(a, np.float16).reshape(-1, n), ((0, 0), (0, np_ - n)))
        return np.ascontiguousarray(a.reshape(-1, np_ // PANEL, PANEL).transpose(1, 0, 2))

    return QTensor(q=np.ascontiguousarray(panels), s=pack_scales(s), z=pack_scales(z), n=n, impl=impl, bits=bits)


def pack_rows(q: np.ndarray, s: np.ndarray, z: np.ndarray | None, impl: str = "kernel", bits: int = 8) -> QTensor:
    """pack() from [out, in] levels and [out, groups] scales and offsets (a checkpoint's
    order): each 64-row block of outputs becomes a panel with one transpose, nibbles
    paired before it, so loading a stage moves each byte about twice instead of four times."""
    n, k = q.shape
    np_ = -(-n // PANEL) * PANEL
    if bits not in (4, 5, 8):
        raise ValueError(f"bits must be 8, 4 or 5, got {bits}")
    rows = np.zeros((np_, k), np.int8 if bits == 8 else np.uint8)
    rows[:n] = q
    rows = rows.reshape(np_ // PANEL, PANEL, k)
    if bits != 8:
        if rows.max(initial=0) >= 1 << bits:
            raise ValueError(f"{bits}-bit levels must lie in 0..{(1 << bits) - 1}")
        low = rows & 15
        fifth = [np.packbits(rows >> 4, axis=1, bitorder="little")] if bits == 5 else []   # [P, 8, k]
        rows = np.concatenate([low[:, :PANEL // 2] | (low[:, PANEL // 2:] << 4), *fifth], axis=1)

    def panels(a: np.ndarray) -> np.ndarray:   # [out, g] -> [Np / 64, g, 64]
        a = np.pad(np.asarray(a, np.float16), ((0, np_ - n), (0, 0)))
        return np.ascontiguousarray(a.reshape(np_ // PANEL, PANEL, a.shape[1]).transpose(0, 2, 1))

    z = None if z is None or bits == 5 else panels(z)    # none stored: `offsets`
    return QTensor(q=np.ascontiguousarray(rows.transpose(0, 2, 1)), s=panels(s), z=z, n=n, impl=impl, bits=bits)


def to_qtensor(w: np.ndarray, impl: str = "kernel", bits: int = 8) -> QTensor:
    """Quantise (GROUP_SIZE groups when they divide the input width, else one) and pack."""
    group = GROUP_SIZE if w.shape[0] % GROUP_SIZE == 0 else None
    d = quantize_int8(w, group) if bits == 8 else quantize_q4(w, group)
    return pack(d["q"], d["s"], d["z"], impl, bits)


def levels(t: QTensor) -> np.ndarray:
    """The [in, out] levels a QTensor holds (int8, or uint8 0..15 for q4)."""
    return np.asarray(_panel_levels(jnp.asarray(t.q), t.bits)).transpose(1, 0, 2).reshape(t.q.shape[1], -1)[:, :t.n]


def dequantize(t: QTensor) -> jax.Array:
    """float32 [in, out]: what the quantised weight stands for."""
    s = jnp.asarray(t.s)
    return _dequantize_panels(_panel_levels(jnp.asarray(t.q), t.bits), s, offsets(s, t.z, t.bits))[:, :t.n]


def offsets(s: Any, z: Any, bits: int) -> jax.Array:
    """The offsets z as float32: the stored ones; where none are stored (z None or empty), -16 s for
    bits 5 (Q5_0; exact in float32), else 0 (GGUF Q8_0: its panels hold its own 8.5 bits a weight)."""
    s = jnp.asarray(s).astype(jnp.float32)
    if bits == 5:
        return s * -16.0
    return jnp.zeros_like(s) if z is None or z.size == 0 else jnp.asarray(z).astype(jnp.float32)


def _panel_levels(q: jax.Array, bits: int) -> jax.Array:
    """Packed panels -> [Np / 64, K, 64] levels (unpacks q4 nibbles, and bits 5's fifth bits)."""
    if bits == 8:
        return q
    half = q[..., :PANEL // 2]
    low = jnp.concatenate([half & 15, half >> 4], axis=-1)
    if bits == 4:
        return low
    fifth = (q[..., PANEL // 2:, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1      # [..., 8 bytes, 8 bits]
    return low | (fifth.reshape(*q.shape[:-1], PANEL) << 4)


def _dequantize_panels(q: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
    p, k, _ = q.shape
    groups = s.shape[1]
    s, z = s.astype(jnp.float32), z.astype(jnp.float32)
    w = q.reshape(p, groups, k // groups, PANEL).astype(jnp.float32) * s[:, :, None] + z[:, :, None]
    return w.reshape(p, k, PANEL).transpose(1, 0, 2).reshape(k, p * PANEL)


def dense(x: jax.Array, w: Any) -> jax.Array:
    """x @ w over the last axis, for a plain [in, out] array or a QTensor.

    The path is chosen while tracing, from the static `impl` (and whether the kernel is built),
    so a trace holds one matmul: jax.lax.platform_dependent traced both the kernel and the
    fallback for every matmul (a third of a q4 stage's trace, measured). The kernel runs on CPU only;
    `for_device` sets `impl` to "xla" for weights on any other device.
    """
    if isinstance(w, ggml.BlockTensor):     # [out, in] GGUF blocks, dequantised in the step
        return ggml.block_dense(x, w)
    if not isinstance(w, QTensor):      # (a gguf matrix dequantised at load is f32 under bf16 activations:
        return (x @ w).astype(x.dtype)  # back to x's dtype, as block_dense does)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    matmul = _kernel_dense if w.impl == "kernel" and kernel_available() else _xla_dense
    y = matmul(x2, w.q, w.s, w.z, bits=w.bits)
    return y[:, :w.n].reshape(*lead, w.n).astype(x.dtype)


def expert_dense(x: jax.Array, w: Any, expert: jax.Array) -> jax.Array:
    """x @ w[expert] for weights stacked over experts (a float [E, in, out] array or a QTensor whose
    leaves lead with E): the expert sliced out (XLA copies it), then `dense`. The CPU kernel's
    path for quantised experts is `moe_ffn`, which reads them in place."""
    return dense(x, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, expert, 0, keepdims=False), w))


def moe_fits(experts: dict[str, Any]) -> bool:
    """Whether the kernel runs these stacked experts in one call (`moe_ffn`): QTensors of one bit width
    asking for the kernel, on a process that has it built."""
    ws = [experts[k] for k in ("w_gate", "w_up", "w_down")]
    return (all(isinstance(w, QTensor) and w.impl == "kernel" and w.bits in MOE_TARGETS and stored_z(w) for w in ws)
            and len({w.bits for w in ws}) == 1 and kernel_available())


def moe_ffn(x: jax.Array, chosen: jax.Array, weights: jax.Array, experts: dict[str, Any]) -> jax.Array:
    """sum_k weights[n, k] * expert_{chosen[n, k]}(x[n]) (SwiGLU) for x [N, D], in one kernel call that
    groups the pairs by expert and reads each chosen expert once, in place (moe_fits must hold)."""
    g, u, d = experts["w_gate"], experts["w_up"], experts["w_down"]
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    y = jax.ffi.ffi_call(MOE_TARGETS[g.bits], out)(
        x.astype(jnp.float32), chosen.astype(jnp.int32), weights.astype(jnp.float32),
        g.q, g.s, g.z, u.q, u.s, u.z, d.q, d.s, d.z, ffn=np.int64(g.n))
    return y.astype(x.dtype)


def matrix_paths(params: Any) -> dict[str, int]:
    """How a stage's matrix products run, counted by path: "kernel q4 panels", "kernel Q4_K blocks",
    "xla float32"... (its layers' matrices and experts, and the head; a lookup table is no product)."""
    counts: dict[str, int] = {}
    mats = [w for layer in params.get("layers", ()) for key, w in layer.items() if key != "experts"]
    mats += [w for layer in params.get("layers", ()) for w in layer.get("experts", {}).values()]
    mats += [params["head"]] if "head" in params else []
    for w in mats:
        if isinstance(w, QTensor):
            name = f"{'kernel' if w.impl == 'kernel' and kernel_available() else 'xla'} q{w.bits} panels"
        elif isinstance(w, ggml.BlockTensor):
            fits = w.impl == "kernel" and w.blocks.ndim == 2 and kernel_available()
            name = f"{'kernel' if fits else 'xla'} {w.kind} blocks"
        elif getattr(w, "ndim", 0) >= 2:
            name = f"xla {w.dtype}"
        else:
            continue     # a bias or a norm
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def for_device(params: Any, device: Any = None) -> Any:
    """`params` with each QTensor that asks for the kernel set to the XLA path when `device`
    (None: JAX's default) is not a CPU; no array moves. SliceRunner applies it to its weights."""
    if (device or jax.devices()[0]).platform == "cpu":
        return params
    return jax.tree.map(lambda t: dataclasses.replace(t, impl="xla") if isinstance(t, QTensor) else t,
                        params, is_leaf=lambda t: isinstance(t, QTensor))


def commit(params: Any, device: Any) -> Any:
    """`params` with each array not yet committed to a device committed to `device` (no copy there);
    committed ones are kept as they are, the same objects, and whatever the tree holds twice (a
    tied head whose columns serve the embedding lookup: one QTensor) stays one object, one buffer."""
    done: dict[int, Any] = {}   # id -> its committed self (every node lives as long as this call)

    def one(node: Any) -> Any:
        if id(node) not in done:
            if isinstance(node, jax.Array) and node.committed:
                done[id(node)] = node
            elif isinstance(node, (jax.Array, np.ndarray)):
                done[id(node)] = jax.device_put(node, device)
            else:   # a container (dict, QTensor, ...): its children, one level down; another leaf stays
                children, tree = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
                leaf = len(children) == 1 and children[0] is node
                done[id(node)] = node if leaf else tree.unflatten([one(c) for c in children])
        return done[id(node)]

    return one(params)


def stored_z(t: QTensor) -> bool:
    """Whether `t` stores its offsets z (else `offsets` makes them)."""
    return t.z is not None and t.z.size > 0


def _kernel_dense(x: jax.Array, q: jax.Array, s: jax.Array, z: jax.Array | None, *, bits: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0] * PANEL), jnp.float32)
    z = jnp.zeros((q.shape[0], 0, PANEL), jnp.float16) if z is None else z   # empty: the loops' `offsets`
    return jax.ffi.ffi_call(KERNEL_TARGETS[bits], out)(x, q, s, z)


def _xla_dense(x: jax.Array, q: jax.Array, s: jax.Array, z: jax.Array | None, *, bits: int) -> jax.Array:
    # Fallback: XLA materialises the f32 weight here (see the module docstring).
    return x @ _dequantize_panels(_panel_levels(q, bits), s, offsets(s, z, bits))


def decode_attention_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel's decode attention takes this head layout (quant_kernel.h's bounds). Only
    where JAX's default backend is the CPU: a GPU or TPU process never builds the CPU kernel for it
    (a stage placed on the CPU there keeps the XLA attention)."""
    return (os.environ.get(ATTENTION_ENV, "kernel").strip().lower() != "xla" and heads % kv_heads == 0
            and heads // kv_heads <= 32 and head_dim % 16 == 0 and head_dim <= 256
            and jax.default_backend() == "cpu" and kernel_available())


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lanes: jax.Array, positions: jax.Array,
                     *, scale: float, limit: int) -> jax.Array:
    """The kernel's decode attention: q [B, H, D] f32, one layer's f32 arenas k, v [lanes, KVH, C, D],
    each row attending to its lane's keys 0..min(position, limit - 1). Returns [B, H, D] f32.
    CPU only; the caller keeps the XLA attention for other devices (llama.attention)."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(ATTEND_TARGET, out)(q.astype(jnp.float32), k, v, lanes.astype(jnp.int32),
                                                positions.astype(jnp.int32), scale=np.float32(scale),
                                                limit=np.int64(limit))
