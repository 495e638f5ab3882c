"""The CPU kernel reading GGUF blocks in place (model/block_kernel_isa.cc; Q3_K, IQ4_XS, IQ4_NL, Q5_1 and
Q2_K unpacked by block_kernel_more_isa.cc), each of ggml.BLOCK_KERNEL_TYPES:
for every instruction set this CPU runs, x @ W.T equals the float64 product of gguf-py's dequantised W
within float32 rounding, on random blocks and on the edge cases (zero blocks, every byte 0xFF,
subnormal, largest and negative f16 scales and mins; a NaN scale gives NaN where gguf-py's does), on
decode rows, row tiles, rows of W not a multiple of the task's 16 and a shape big enough for the thread
pool; a row's result is the same whichever rows share its call. The ISA is switched in this process
through the library's own skippy_kernel_select (what SKIPPY_KERNEL_ISA goes through at load; the
handler reads the choice on every call), so one interpreter and one compile per shape serve every
ISA; tests/test_quant_kernel.py covers the variable itself in fresh interpreters.
(Infinite scales are left out: inf - inf makes NaN or inf by the order of the sums, no tolerance.)"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skippy_zmq.model import ggml, kernel, quant
from test_quant_ggml import F16_FIELDS

EDGE = (0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x8001, 0x0000, 0x8000)
BLOCK_DENSE = jax.jit(ggml.block_dense)     # one compile per shape, shared by every ISA's run


def random_blocks(rng, kind: str, n: int, k: int) -> np.ndarray:
    t = ggml.TYPES[kind]
    raw = rng.integers(0, 256, (n, k // t.block, t.nbytes), dtype=np.uint8)
    for f in F16_FIELDS[kind]:
        scale = rng.uniform(2.0 ** -10, 2.0 ** -4, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., f:f + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def edge_blocks(rng, kind: str, k: int) -> np.ndarray:
    t = ggml.TYPES[kind]
    per = k // t.block
    rows = [np.zeros(k // t.block * t.nbytes, np.uint8), np.full(per * t.nbytes, 255, np.uint8)]
    base = random_blocks(rng, kind, 1, k)[0].reshape(per, t.nbytes)
    for value in EDGE:
        for fields in [(f,) for f in F16_FIELDS[kind]] + [tuple(F16_FIELDS[kind])]:
            for body in (base, np.zeros_like(base), np.full_like(base, 255)):
                row = body.copy()
                for f in fields:
                    row[:, f:f + 2] = np.array([value], "<u2").view(np.uint8)
                rows.append(row.reshape(-1))
    return np.stack(rows)


def check_every_type(skip: tuple[str, ...] = ()) -> dict:
    """Every block type (but `skip`) on every case under the ISA selected now: the worst error relative to
    sum |x||w|, whether a row alone equals it in company, whether NaNs sit where gguf-py's are."""
    rng = np.random.default_rng(0)
    worst, alone, nan_same = 0.0, True, True
    for kind in ggml.BLOCK_KERNEL_TYPES:
        if kind in skip:
            continue
        cases = [(m, random_blocks(rng, kind, n, k)) for m, n, k in
                 [(1, 40, 512), (2, 17, 256), (3, 16, 768), (5, 33, 1024), (9, 7, 256), (8, 640, 1024)]]
        cases.append((4, edge_blocks(rng, kind, 512)))
        if ggml.TYPES[kind].block == 32:     # K not a multiple of 256: runs of 16 left over a whole vector
            cases += [(m, random_blocks(rng, kind, n, k)) for m, n, k in [(1, 24, 576), (3, 5, 96), (2, 9, 32)]]
        for m, raw in cases:
            k = raw.shape[1] // ggml.TYPES[kind].nbytes * ggml.TYPES[kind].block
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float64)
            t = ggml.BlockTensor(jnp.asarray(raw), kind, impl="kernel")
            got = np.asarray(BLOCK_DENSE(jnp.asarray(x), t))
            one = np.asarray(BLOCK_DENSE(jnp.asarray(x[-1:]), t))
            want = x.astype(np.float64) @ w.T
            bound = np.abs(x).astype(np.float64) @ np.abs(w).T          # float32 rounding scales with this
            nan = np.isnan(want)                                        # a 0xFFFF (NaN) scale in a 0xFF body
            nan_same &= bool(np.array_equal(np.isnan(got), nan))
            err = np.abs(got - want) / np.maximum(bound, 1e-30)
            worst = max(worst, float(np.where(nan, 0.0, err).max()))
            alone &= bool(np.array_equal(one[0], got[-1], equal_nan=True))
    return {"worst": worst, "alone": alone, "nan_same": nan_same}


def isas() -> list[str]:
    if not shutil.which(os.environ.get("CXX") or "g++"):
        return []
    return quant.supported_isas()


@contextlib.contextmanager
def selected(isa: str):
    """The kernel's loops switched to `isa` for the block, then back to this process's own choice."""
    loaded = kernel._load_kernel()
    assert kernel._select_isa(loaded.lib, isa) == isa
    try:
        yield isa
    finally:
        assert kernel._select_isa(loaded.lib, loaded.isa) == loaded.isa


@pytest.mark.parametrize("isa", quant.kernel_isas())
def test_block_kernel_matches_the_dequantised_product_on_every_isa(isa):
    if isa not in isas():
        pytest.skip(f"this CPU (or a missing compiler) does not run the {isa} loops")
    # avx512vnni and avx2int8 run their ggml.INT8_TYPES_BY_ISA on int8 activations: tests/test_quant_kernel.py
    # checks them against their own models
    with selected(isa), jax.default_device(jax.devices("cpu")[0]):   # the kernel is a CPU kernel
        got = check_every_type(ggml.INT8_TYPES_BY_ISA.get(isa, ()))
    assert got["worst"] < 1e-5 and got["alone"] and got["nan_same"], (isa, got)


def test_block_kernel_types_are_the_glues():
    """The Python list of types the kernel reads and the glue's type ids agree (quant_kernel.h)."""
    header = "".join((Path(quant.KERNEL_DIR) / name).read_text() for name in ("quant_kernel.h", "block_kernel_more.h"))
    for kind in ggml.BLOCK_KERNEL_TYPES:
        assert f"#define SKIPPY_GGML_{kind} {ggml.TYPE_IDS[kind]}\n" in header
    for name, types in (("skippy_int8_block_type", ggml.INT8_BLOCK_TYPES),
                        ("skippy_int8_block_type_avx2", ggml.INT8_BLOCK_TYPES_AVX2)):
        int8 = header.split(f"int {name}(")[1].split("}\n}")[0]
        assert sorted(re.findall(r"case SKIPPY_GGML_(\w+):", int8)) == sorted(types), name
