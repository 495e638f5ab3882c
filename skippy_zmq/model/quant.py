"""Weight-only int8: int8 weights in memory, float32 scales per group of 32 inputs.

Decode on CPU is memory-bound (every weight is read once per token), so
reading 1 byte per weight instead of 4 is the whole point. XLA CPU cannot do
that by itself: measured on this repo's CPU, every XLA formulation of an int8
matmul (convert then dot, dot_general with preferred_element_type, int8 x int8
-> int32 with dynamic activation scales, convert-multiply-reduce) materialises
the widened weight and runs 10-20x slower than the f32 dot. So on CPU the
QTensor matmul is a small native kernel (quant_kernel.cc, through the XLA FFI)
that widens int8 in registers; elsewhere, or without a C++ compiler, it falls
back to the correct but slow XLA dequantise-then-dot.

Each group of 32 input rows of a column gets W ~= q * s + z, whichever of a
symmetric grid (z = 0) or a min/max grid reconstructs it better. Why: a
per-column scale moved logits by up to ~2 (mean 0.23), far above the ~0.04
top-1/top-2 margins of the parity prompts; groups of 32 match how GGUF
files quantise, and the two grids contain Q4_1's and Q8_0's levels exactly,
so weights converted from such a file are reproduced to float rounding.

Weights are packed for the kernel as 64-column panels (Np = out rounded up
to 64, padding columns are zero): q[Np / 64, K, 64], s and z [Np / 64, groups, 64].
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

PANEL = 64
GROUP_SIZE = 32   # input rows per scale; to_qtensor falls back to one group when it does not divide
KERNEL_TARGET = "skippy_int8_dense"
KERNEL_SOURCE = Path(__file__).with_name("quant_kernel.cc")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """An int8 [in, out] weight packed in panels: W[k, n] = q[k, n] * s[g, n] + z[g, n]
    with g = k // (in / groups).

    `n` (the logical out width) and `impl` ("kernel" | "xla") are static, so
    they are part of the jit cache key, never traced.
    """

    q: Any   # int8 [Np / 64, in, 64]
    s: Any   # float32 [Np / 64, groups, 64]
    z: Any   # float32 [Np / 64, groups, 64]
    n: int = dataclasses.field(metadata=dict(static=True))
    impl: str = dataclasses.field(default="kernel", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[1], self.n)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes + self.z.nbytes


def quantize_int8(w: np.ndarray, group_size: int | None = None,
                  offsets: bool = True) -> dict[str, np.ndarray]:
    """int8 weights: w[k, j] ~= q[k, j] * s[g, j] + z[g, j], g = k // group_size.

    group_size None: one group (per output channel; s and z are then [out]).
    offsets False: symmetric only (z = 0). Otherwise each (group, column)
    takes whichever of the symmetric or min/max grid has the smaller max error.
    """
    w = np.asarray(w, np.float32)
    k, n = w.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"group_size {g} does not divide the input width {k}")
    w3 = w.reshape(k // g, g, n)
    lo, hi = w3.min(axis=1), w3.max(axis=1)
    best = _grid(w3, np.maximum(-lo, hi) / 127.0, np.zeros_like(lo))       # symmetric
    if offsets:
        step = (hi - lo) / 255.0                                             # q = -128 at the min
        best = _pick(best, _grid(w3, step, lo + 128.0 * step))
    q, s, z, _ = best
    if group_size is None:
        s, z = s[0], z[0]
    return {"q": q.reshape(k, n), "s": s.astype(np.float32), "z": z.astype(np.float32)}


def _grid(w3: np.ndarray, s: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, ...]:
    """Round onto q * s + z; returns (q, s, z, max error per group and column)."""
    safe = np.where(s > 0, s, 1.0)                                           # constant groups: q = 0
    q = np.clip(np.rint((w3 - z[:, None]) / safe[:, None]), -128, 127)
    err = np.abs(q * s[:, None] + z[:, None] - w3).max(axis=1)
    return q.astype(np.int8), s, z, err


def _pick(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    take_b = b[3] < a[3]
    return (np.where(take_b[:, None], b[0], a[0]), np.where(take_b, b[1], a[1]),
            np.where(take_b, b[2], a[2]), np.minimum(a[3], b[3]))


def pack(q: np.ndarray, s: np.ndarray, z: np.ndarray | None = None, impl: str = "kernel") -> QTensor:
    """[in, out] int8 + [out] or [groups, out] scales (and offsets) -> 64-column panels."""
    k, n = q.shape
    np_ = -(-n // PANEL) * PANEL
    padded = np.zeros((k, np_), np.int8)
    padded[:, :n] = q
    panels = np.ascontiguousarray(padded.reshape(k, np_ // PANEL, PANEL).transpose(1, 0, 2))
    z = np.zeros_like(s) if z is None else z

    def pack_scales(a: np.ndarray) -> np.ndarray:   # [groups, out] -> [Np / 64, groups, 64]
        a = np.pad(np.asarray(a, np.float32).reshape(-1, n), ((0, 0), (0, np_ - n)))
        return np.ascontiguousarray(a.reshape(-1, np_ // PANEL, PANEL).transpose(1, 0, 2))

    return QTensor(q=panels, s=pack_scales(s), z=pack_scales(z), n=n, impl=impl)


def to_qtensor(w: np.ndarray, impl: str = "kernel") -> QTensor:
    """Quantise (GROUP_SIZE groups when they divide the input width, else one) and pack."""
    group = GROUP_SIZE if w.shape[0] % GROUP_SIZE == 0 else None
    d = quantize_int8(w, group)
    return pack(d["q"], d["s"], d["z"], impl)


def dequantize(t: QTensor) -> jax.Array:
    """float32 [in, out]: what the int8 weight stands for."""
    return _dequantize_panels(jnp.asarray(t.q), jnp.asarray(t.s), jnp.asarray(t.z))[:, :t.n]


def _dequantize_panels(q: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
    p, k, _ = q.shape
    groups = s.shape[1]
    w = q.reshape(p, groups, k // groups, PANEL).astype(jnp.float32) * s[:, :, None] + z[:, :, None]
    return w.reshape(p, k, PANEL).transpose(1, 0, 2).reshape(k, p * PANEL)


def dense(x: jax.Array, w: Any) -> jax.Array:
    """x @ w over the last axis, for a plain [in, out] array or a QTensor."""
    if not isinstance(w, QTensor):
        return x @ w
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    if w.impl == "kernel" and kernel_available():
        y = jax.lax.platform_dependent(x2, w.q, w.s, w.z, cpu=_kernel_dense, default=_xla_dense)
    else:
        y = _xla_dense(x2, w.q, w.s, w.z)
    return y[:, :w.n].reshape(*lead, w.n).astype(x.dtype)


def _kernel_dense(x: jax.Array, q: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(KERNEL_TARGET, out)(x, q, s, z)


def _xla_dense(x: jax.Array, q: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
    # Fallback: XLA materialises the f32 weight here (see the module docstring).
    return x @ _dequantize_panels(q, s, z)


def kernel_available() -> bool:
    """Whether the CPU kernel is built (once per machine and source) and registered."""
    return _load_kernel() is not None


@functools.cache   # holds the loaded library, so it stays mapped for the life of the process
def _load_kernel() -> ctypes.CDLL | None:
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build_kernel()))
    except subprocess.CalledProcessError as exc:
        log.warning("int8 CPU kernel failed to build, using the slow XLA fallback:\n%s", exc.stderr[-2000:])
        return None
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        log.warning("int8 CPU kernel unavailable, using the slow XLA fallback: %s", exc)
        return None
    jax.ffi.register_ffi_target(KERNEL_TARGET, jax.ffi.pycapsule(lib.skippy_int8_dense), platform="cpu")
    return lib


def _build_kernel() -> Path:
    cxx = os.environ.get("CXX", "g++")
    include = jax.ffi.include_dir()
    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w"]
    # -march=native binaries belong to this CPU: key the cache on it too.
    key = hashlib.sha256(KERNEL_SOURCE.read_bytes() + " ".join(
        [cxx, *flags, include, jax.__version__, _cpu_signature()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "skippy_zmq"
    target = cache / f"quant_kernel-{key}.so"
    if not target.is_file():
        if shutil.which(cxx) is None:
            raise RuntimeError(f"no C++ compiler ({cxx}) on PATH")
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:   # build aside, publish atomically
            out = Path(tmp) / target.name
            subprocess.run([cxx, *flags, "-I", include, str(KERNEL_SOURCE), "-o", str(out)],
                           check=True, capture_output=True, text=True, timeout=300)
            os.replace(out, target)
    return target


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.machine() + platform.processor()
