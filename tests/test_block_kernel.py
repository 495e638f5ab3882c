"""The CPU kernel reading GGUF blocks in place (model/block_kernel_isa.cc; Q3_K, IQ4_XS, IQ4_NL, Q5_1 and
Q2_K unpacked by block_kernel_more_isa.cc), each of ggml.BLOCK_KERNEL_TYPES:
for every instruction set this CPU runs (each in a fresh interpreter, since the ISA is chosen once per
process), x @ W.T equals the float64 product of gguf-py's dequantised W within float32 rounding, on
random blocks and on the edge cases (zero blocks, every byte 0xFF, subnormal, largest and negative f16
scales and mins; a NaN scale gives NaN where gguf-py's does), on decode rows, row tiles, rows of W not a multiple of the task's 16 and a shape big
enough for the thread pool; a row's result is the same whichever rows share its call.
(Infinite scales are left out: inf - inf makes NaN or inf by the order of the sums, no tolerance.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq.model import ggml, quant

CHILD = """
import json, sys
import gguf, jax, jax.numpy as jnp, numpy as np
from skippy_zmq.model import ggml, quant

FIELDS = json.loads(sys.argv[1])           # type -> byte offsets of its f16 scales and mins
EDGE = (0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x8001, 0x0000, 0x8000)
rng = np.random.default_rng(0)

def random_blocks(kind, n, k):
    t = ggml.TYPES[kind]
    raw = rng.integers(0, 256, (n, k // t.block, t.nbytes), dtype=np.uint8)
    for f in FIELDS[kind]:
        scale = rng.uniform(2.0 ** -10, 2.0 ** -4, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., f:f + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)

def edge_blocks(kind, k):
    t = ggml.TYPES[kind]
    per = k // t.block
    rows = [np.zeros(k // t.block * t.nbytes, np.uint8), np.full(per * t.nbytes, 255, np.uint8)]
    base = random_blocks(kind, 1, k)[0].reshape(per, t.nbytes)
    for value in EDGE:
        for fields in [(f,) for f in FIELDS[kind]] + [tuple(FIELDS[kind])]:
            for body in (base, np.zeros_like(base), np.full_like(base, 255)):
                row = body.copy()
                for f in fields:
                    row[:, f:f + 2] = np.array([value], "<u2").view(np.uint8)
                rows.append(row.reshape(-1))
    return np.stack(rows)

worst, alone, nan_same = 0.0, True, True
for kind in ggml.BLOCK_KERNEL_TYPES:
    cases = [(m, random_blocks(kind, n, k)) for m, n, k in
             [(1, 40, 512), (2, 17, 256), (3, 16, 768), (5, 33, 1024), (9, 7, 256), (8, 640, 1024)]]
    cases.append((4, edge_blocks(kind, 512)))
    if ggml.TYPES[kind].block == 32:     # K not a multiple of 256: runs of 16 left over a whole vector
        cases += [(m, random_blocks(kind, n, k)) for m, n, k in [(1, 24, 576), (3, 5, 96), (2, 9, 32)]]
    for m, raw in cases:
        k = raw.shape[1] // ggml.TYPES[kind].nbytes * ggml.TYPES[kind].block
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float64)
        t = ggml.BlockTensor(jnp.asarray(raw), kind, impl="kernel")
        got = np.asarray(jax.jit(ggml.block_dense)(jnp.asarray(x), t))
        one = np.asarray(jax.jit(ggml.block_dense)(jnp.asarray(x[-1:]), t))
        want = x.astype(np.float64) @ w.T
        bound = np.abs(x).astype(np.float64) @ np.abs(w).T          # float32 rounding scales with this
        nan = np.isnan(want)                                        # a 0xFFFF (NaN) scale in a 0xFF body
        nan_same &= bool(np.array_equal(np.isnan(got), nan))
        err = np.abs(got - want) / np.maximum(bound, 1e-30)
        worst = max(worst, float(np.where(nan, 0.0, err).max()))
        alone &= bool(np.array_equal(one[0], got[-1], equal_nan=True))
print(json.dumps({"isa": quant.kernel_isa(), "worst": worst, "alone": alone, "nan_same": nan_same}))
"""


def isas() -> list[str]:
    if not shutil.which(os.environ.get("CXX") or "g++"):
        return []
    return quant.supported_isas()


@pytest.mark.parametrize("isa", quant.kernel_isas())
def test_block_kernel_matches_the_dequantised_product_on_every_isa(tmp_path, isa):
    from test_quant_ggml import F16_FIELDS

    if isa not in isas():
        pytest.skip(f"this CPU (or a missing compiler) does not run the {isa} loops")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SKIPPY_KERNEL_ISA": isa}
    fields = json.dumps({k: F16_FIELDS[k] for k in ggml.BLOCK_KERNEL_TYPES})
    out = subprocess.run([sys.executable, "-c", CHILD, fields], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["isa"] == isa
    assert got["worst"] < 1e-5 and got["alone"] and got["nan_same"], got


def test_block_kernel_types_are_the_glues():
    """The Python list of types the kernel reads and the glue's type ids agree (quant_kernel.h)."""
    header = "".join((Path(quant.KERNEL_DIR) / name).read_text() for name in ("quant_kernel.h", "block_kernel_more.h"))
    for kind in ggml.BLOCK_KERNEL_TYPES:
        assert f"#define SKIPPY_GGML_{kind} {ggml.TYPE_IDS[kind]}\n" in header
