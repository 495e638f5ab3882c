"""The native quantised-matmul kernel as a dependency: built into a user cache
(never the source tree), one library with per-ISA loops picked at load time,
SKIPPY_KERNEL_ISA forcing a path, and exactly one warning plus the XLA
fallback when no compiler exists. The cases of how a path is chosen or built run in a fresh
interpreter, since the kernel is loaded once per process; the int8-activation loops' cases switch
the loaded library's loops in this process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq.model import ggml, kernel, quant

X86 = platform.machine().lower() in ("x86_64", "amd64")

# Compares the kernel (whatever the environment selects) with the XLA fallback
# and the dequantised matmul, for int8 and q4, on decode rows, small row tiles
# (M up to 16), one group, out not a multiple of 64, a shape big enough to run
# on the thread pool, and a prefill chunk; scales and offsets are float16.
# A forced or auto-picked ISA runs every shape (its loops are what it tests); the cases that test
# how a path is chosen or built run two (SHAPES=short: a small tile and the pool).
FULL = [(1, 576, 192), (2, 64, 97), (3, 1536, 64), (5, 96, 130), (33, 128, 64), (1, 32, 65),
        (4, 32, 200), (7, 160, 127), (16, 96, 70), (1, 2048, 2100), (2, 2048, 2100)]
SHORT = [(5, 96, 130), (2, 2048, 2100)]
CHILD = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from skippy_zmq.model import quant

shapes = json.loads(os.environ["SHAPES"])
rng = np.random.default_rng(0)
worst = 0.0
for bits in (8, 4):
    for m, k, n in shapes:
        w = rng.standard_normal((k, n)).astype(np.float32)
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        kernel, xla = (jax.tree.map(jnp.asarray, quant.to_qtensor(w, impl, bits)) for impl in ("kernel", "xla"))
        assert kernel.s.dtype == kernel.z.dtype == jnp.float16
        # one compile per shape: both paths and the dequantised weight (eagerly, each op compiled alone)
        got, fallback, dense_w = jax.jit(lambda x, a, b: (quant.dense(x, a), quant.dense(x, b),
                                                          quant.dequantize(a)))(x, kernel, xla)
        got, want = np.asarray(got), np.asarray(x) @ np.asarray(dense_w, np.float64)
        for other in (np.asarray(fallback), want):
            worst = max(worst, float(np.abs(got - other).max() / np.abs(want).max()))
# decode attention: rows in different lanes at different positions (one a padding row at the
# capacity, one lane out of range, clamped), 2 query heads per KV head, against numpy
attn = 0.0
if quant.kernel_available():
    lanes_n, kvh, cap, d, limit = 3, 2, 40, 32, 33
    k, v = (rng.standard_normal((lanes_n, kvh, cap, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((4, 4, d)).astype(np.float32)
    lanes, positions = np.array([2, 0, 7, 1], np.int32), np.array([0, 17, 32, 39], np.int32)
    got = np.asarray(quant.decode_attention(*map(jnp.asarray, (q, k, v, lanes, positions)), scale=0.3, limit=limit))
    for b in range(4):
        lane, n = min(lanes[b], lanes_n - 1), min(positions[b] + 1, limit)
        for h in range(4):
            s = 0.3 * k[lane, h // 2, :n] @ q[b, h]
            p = np.exp(s - s.max())
            attn = max(attn, float(np.abs(got[b, h] - p @ v[lane, h // 2, :n] / p.sum()).max()))
print(json.dumps({"available": quant.kernel_available(), "isa": globals().get("ISA") or quant.kernel_isa(), "worst": worst,
                  "attention": attn}))
"""


def run_child(tmp_path: Path, shapes: list = SHORT, **env: str) -> tuple[dict, str]:
    full = {**os.environ, "JAX_PLATFORMS": "cpu", "SHAPES": json.dumps(shapes), **env}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tmp_path, env=full, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def cpu_flags() -> set[str]:
    try:
        return {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                for f in line.split(":", 1)[1].split()}
    except OSError:
        return set()


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_forced_isa_runs_and_matches_the_xla_fallback(tmp_path, isa):
    """The AVX2 (or generic) loops run even on an AVX-512 CPU (as CI's is) and give the fallback's
    values: switched in this process through the call SKIPPY_KERNEL_ISA makes at load (the variable
    itself: test_auto_picks_the_best_isa_this_cpu_supports)."""
    if not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip("no C++ compiler")
    if isa == "avx2" and not (X86 and {"avx2", "fma", "f16c"} <= cpu_flags()):
        pytest.skip("this CPU has no AVX2")
    got = run_in_process(CHILD, isa, SHAPES=json.dumps(FULL))
    assert got["available"] and got["isa"] == isa
    assert got["worst"] < 1e-5 and got["attention"] < 1e-5


def test_auto_picks_the_best_isa_this_cpu_supports(tmp_path):
    if not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip("no C++ compiler")
    flags = cpu_flags()
    if X86 and {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"} <= flags:
        best = "avx512"
    elif X86 and {"avx2", "fma", "f16c"} <= flags:
        best = "avx2"
    else:
        best = "generic"
    got, stderr = run_child(tmp_path, FULL, SKIPPY_KERNEL_ISA="auto")   # the loops this CPU runs
    assert got["isa"] == best and got["worst"] < 1e-5 and got["attention"] < 1e-5
    got, stderr = run_child(tmp_path, SKIPPY_KERNEL_ISA="sse9")
    assert got["isa"] == best and "SKIPPY_KERNEL_ISA=sse9 is unknown or not supported" in stderr


def test_no_compiler_means_the_xla_fallback_and_exactly_one_warning(tmp_path):
    cache = tmp_path / "empty-cache"
    got, stderr = run_child(tmp_path, CXX=str(tmp_path / "no-such-compiler"), SKIPPY_KERNEL_CACHE=str(cache))
    assert got == {"available": False, "isa": None, "worst": got["worst"], "attention": 0.0} and got["worst"] < 1e-5
    warnings = [line for line in stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, stderr
    assert "CPU kernel unavailable, using the slow XLA fallback" in warnings[0]
    assert "no C++ compiler" in warnings[0] and "no-such-compiler" in warnings[0]
    assert not cache.exists()


@pytest.mark.parametrize("source, exported", [
    ("quant_kernel_isa.cc", ["skippy_attend_avx2", "skippy_int8_panel_avx2", "skippy_q4_panel_avx2", "skippy_q5_panel_avx2"]),
    ("block_kernel_isa.cc", ["skippy_blocks_avx2"]),
    ("block_kernel_more_isa.cc", ["skippy_unpack_more_avx2"])])
def test_avx2_loops_hold_no_avx512_instruction_and_share_no_symbol(tmp_path, source, exported):
    """Compile each per-ISA file as the AVX2 variant is built and read the code: no zmm, no mask
    or upper-16 vector register, so the AVX2 path can run on an AVX2-only CPU; and the
    object exports its entry points only (no weak inline copy the linker could hand
    to another ISA's caller)."""
    cxx = shutil.which(os.environ.get("CXX") or "g++")
    if not (X86 and cxx and shutil.which("objdump") and shutil.which("nm")):
        pytest.skip("needs x86-64, a C++ compiler and binutils")
    obj = tmp_path / "avx2.o"
    subprocess.run([cxx, *quant.CXX_FLAGS, *quant.ISA_FLAGS["avx2"], "-DSKIPPY_ISA=avx2", "-c",
                    str(quant.KERNEL_DIR / source), "-o", str(obj)], check=True, timeout=300)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True, capture_output=True,
                         text=True).stdout
    assert "ymm" in asm                                          # it is vectorised
    assert not re.search(r"zmm|%k[0-7]|[xy]mm(1[6-9]|2[0-9]|3[01])", asm)
    symbols = subprocess.run(["nm", "--extern-only", "--defined-only", str(obj)], check=True, capture_output=True,
                             text=True).stdout.split()
    assert sorted(symbols[2::3]) == exported


INT8_CHILD = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from skippy_zmq.model import quant

def emulate(x, t):
    # int8 activations as quant_kernel.h defines them, in numpy: blocks of 32 inputs per row,
    # step amax / 127, levels rounded to nearest even; exact integer sums, then the steps
    lv = quant.levels(t).astype(np.int64)
    k = lv.shape[0]
    s, z = (np.asarray(a, np.float32).transpose(1, 0, 2).reshape(a.shape[1], -1)[:, :t.n]
            for a in (t.s, quant.offsets(t.s, t.z, t.bits)))
    groups = s.shape[0]
    xb = x.reshape(len(x), k // 32, 32)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)
    part = np.einsum("mbk,bkn->mbn", xq, lv.reshape(k // 32, 32, -1)) * (amax / np.float32(127))[..., None]
    part = part.reshape(len(x), groups, -1, t.n).sum(2)
    xs = xb.astype(np.float64).sum(-1).reshape(len(x), groups, -1).sum(2)
    return (part * s + xs[..., None] * z).sum(1)

def gguf_panels(rng, kind, k, n):
    # GGUF Q5_0 and Q8_0 as the checkpoint keeps them: levels 0..31 (offsets -16 s) or -127..127 (none)
    # with a scale per 32 inputs, no offsets stored
    bits, lo, hi = (5, 0, 32) if kind == "Q5_0" else (8, -127, 128)
    lv = rng.integers(lo, hi, (n, k)).astype(np.uint8 if bits == 5 else np.int8)
    s = (rng.uniform(2.0 ** -10, 2.0 ** -4, (n, k // 32)) * rng.choice([-1, 1], (n, k // 32))).astype(np.float16)
    return quant.pack_rows(lv, s, None, "kernel", bits)

rng = np.random.default_rng(0)
out = {"isa": ISA, "exact": 0.0, "vs_f32": 0.0, "row_alone_same": True}
for bits in (8, 4, "Q5_0", "Q8_0"):
    for m, k, n in [(1, 576, 192), (2, 64, 97), (5, 96, 130), (9, 576, 1536), (1, 2048, 2100), (3, 32, 65)]:
        w = rng.standard_normal((k, n)).astype(np.float32)
        x = rng.standard_normal((m, k)).astype(np.float32)
        t = quant.to_qtensor(w, "kernel", bits) if isinstance(bits, int) else gguf_panels(rng, bits, k, n)
        kt = jax.tree.map(jnp.asarray, t)
        got = np.asarray(jax.jit(quant.dense)(jnp.asarray(x), kt))
        one = np.asarray(jax.jit(quant.dense)(jnp.asarray(x[-1:]), kt))
        ref = x.astype(np.float64) @ np.asarray(quant.dequantize(t), np.float64)
        scale = np.abs(ref).max()
        out["exact"] = max(out["exact"], float(np.abs(got - emulate(x, t)).max() / scale))
        out["vs_f32"] = max(out["vs_f32"], float(np.abs(got - ref).max() / scale))
        out["row_alone_same"] &= bool(np.array_equal(one[0], got[-1]))
print(json.dumps(out))
"""


def test_int8_activation_loops_compute_exactly_what_they_define(tmp_path):
    """SKIPPY_KERNEL_ISA=avx512vnni (opt-in, never "auto"), every panel format (int8 and 4-bit with their
    offsets, GGUF Q5_0's 5-bit and Q8_0's int8 with none): x quantised to int8 per block of 32,
    summed exactly in int32 by vpdpbusd, equals a numpy model of that arithmetic to float rounding,
    is the same for a row whether or not other rows share the call, and is within int8 rounding
    (a few 1e-3 of the output scale) of the float matmul."""
    got = run_int8_child(tmp_path, INT8_CHILD)
    assert got["isa"] == "avx512vnni" and got["row_alone_same"]
    assert got["exact"] < 1e-5
    assert 1e-4 < got["vs_f32"] < 3e-2


INT8_COMMON = """
def quantise_x(x):
    # quant_kernel.h's int8 activations: per 32 inputs, step amax / 127, levels x * (127 / amax) in float32
    # rounded half to even; the blocks' exact sums
    xb = x.reshape(len(x), -1, 32)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)
    return xq, (amax / np.float32(127)).astype(np.float64), xb.astype(np.float64).sum(-1)

OUT = {"exact": 0.0, "vs_f32": 1.0, "vs_f32_max": 0.0, "alone": True, "parse": True}

def check(out, dense, x, t, w, emu):
    # the kernel's x @ W.T for the block tensor t: against the float64 model of its int8 arithmetic (emu),
    # against the float product of gguf-py's dequantised w (smallest and largest error), and each row alone,
    # the first r + 1 rows together and the rows reversed giving the same bits as the whole call
    got = np.asarray(dense(jnp.asarray(x), t))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    out["exact"] = max(out["exact"], float(np.abs(got - emu).max() / np.abs(emu).max()))
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    out["vs_f32"], out["vs_f32_max"] = min(out["vs_f32"], err), max(out["vs_f32_max"], err)
    for r in range(len(x)):
        out["alone"] &= bool(np.array_equal(np.asarray(dense(jnp.asarray(x[r:r + 1]), t))[0], got[r]))
        out["alone"] &= bool(np.array_equal(np.asarray(dense(jnp.asarray(x[:r + 1]), t)), got[:r + 1]))
    out["alone"] &= bool(np.array_equal(np.asarray(dense(jnp.asarray(x[::-1].copy()), t)), got[::-1]))
"""


Q4_K_INT8_CHILD = """
import json
import gguf, jax, jax.numpy as jnp, numpy as np
from skippy_zmq.model import ggml, quant

def q4_k_blocks(rng, n, k):
    # random Q4_K rows [n, k / 256 * 144]: random bytes, modest f16 d and dmin of either sign
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        f = rng.uniform(2.0 ** -10, 2.0 ** -4, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., at:at + 2] = f.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)

def q4_k_parts(raw, k):
    # per 32-input sub-block d * sc_s and dmin * m_s [n, k / 32] (float64, exact) and the levels [n, k]
    b = raw.reshape(raw.shape[0], k // 256, 144)
    d, dmin = (b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64) for at in (0, 2))
    q = b[..., 4:16].astype(np.int64)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 32).astype(np.int64)
    lv = np.stack([qs & 15, qs >> 4], 3).reshape(raw.shape[0], k)   # sub-block 2j: low nibbles, 2j + 1: high
    return (d[..., None] * sc).reshape(raw.shape[0], -1), (dmin[..., None] * mn).reshape(raw.shape[0], -1), lv

""" + INT8_COMMON + """

def model(x, raw):
    # y = sum_s (d sc_s) xd[s] isum[s] - sum_s (dmin m_s) xs[s], isum exact integers, the rest float64
    scale, shift, lv = q4_k_parts(raw, x.shape[1])
    xq, xd, xs = quantise_x(x)
    isum = np.einsum("msk,nsk->mns", xq, lv.reshape(len(raw), -1, 32))
    return (isum * scale[None] * xd[:, None]).sum(-1) - xs @ shift.T

dense = jax.jit(ggml.block_dense)
out = {"isa": ISA, **OUT}
rng = np.random.default_rng(0)
for m, k, n in [(1, 256, 37), (2, 512, 50), (3, 1024, 23), (4, 2048, 70), (5, 768, 19), (6, 1536, 41),
                (1, 2048, 300), (6, 256, 5), (9, 512, 21), (13, 256, 40)]:   # (9, 13: prefill-sized calls)   # (1, 2048, 300): enough work for the pool's helpers
    raw = q4_k_blocks(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0                                      # a zero block: step 0
    w = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K), np.float32)
    scale, shift, lv = q4_k_parts(raw, k)              # (the model's reading of the blocks is gguf-py's)
    out["parse"] &= bool(np.array_equal((np.repeat(scale, 32, 1) * lv - np.repeat(shift, 32, 1)).astype(np.float32), w))
    t = ggml.BlockTensor(jnp.asarray(raw), "Q4_K", impl="kernel")
    check(out, dense, x, t, w, model(x, raw))
print(json.dumps(out))
"""


def run_int8_child(tmp_path, code: str, *args: str, isa: str = "avx512vnni") -> dict:
    """`code` (given `args` as sys.argv[1:]) on the int8 loops of `isa` (avx512vnni or avx2int8;
    run_in_process): the JSON of its last printed line; skips where there is no compiler or the CPU lacks
    the ISA's flags (kernel.CPU_FLAGS)."""
    if not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip("no C++ compiler")
    if not (X86 and kernel.CPU_FLAGS[isa] <= cpu_flags()):
        pytest.skip(f"this CPU cannot run the {isa} loops")
    return run_in_process(code, isa, *args)


# The int8 ISAs and the block types each runs on int8 activations (ggml.INT8_TYPES_BY_ISA): a test of a
# type's int8 loop runs once per ISA that lists it.
def int8_cases(*kinds: str) -> list:
    return [(isa, kind) for isa, types in ggml.INT8_TYPES_BY_ISA.items() for kind in kinds if kind in types]


def run_in_process(code: str, isa: str, *args: str, **env: str) -> dict:
    """`code` (given `args` as sys.argv[1:], `env` in os.environ, `ISA` the loops it runs on) run in this
    process with the kernel's loops switched to `isa` through the library's own skippy_kernel_select,
    the call SKIPPY_KERNEL_ISA makes at load (test_block_kernel.selected), and back after: the JSON of
    its last printed line. Not a fresh interpreter each: ~1.3 CPU s of imports and kernel load a case."""
    import jax
    from test_block_kernel import selected

    printed, argv = io.StringIO(), sys.argv
    with (pytest.MonkeyPatch.context() as patch, selected(isa), jax.default_device(jax.devices("cpu")[0]),
          contextlib.redirect_stdout(printed)):
        for key, value in env.items():
            patch.setenv(key, value)
        sys.argv = ["kernel-case", *args]
        try:
            exec(compile(code, "<kernel case>", "exec"), {"__name__": "kernel_case", "ISA": isa})
        finally:
            sys.argv = argv
    return json.loads(printed.getvalue().strip().splitlines()[-1])


@pytest.mark.parametrize("isa", [isa for isa, _ in int8_cases("Q4_K")])
def test_q4_k_int8_activation_decode_computes_exactly_what_it_defines(tmp_path, isa):
    """SKIPPY_KERNEL_ISA=avx512vnni (and avx2int8) runs GGUF Q4_K blocks (every M) on int8 activations: equal to a
    float64 numpy model of that arithmetic (x quantised per 32 inputs as quant_kernel.h says, exact integer
    sums of level * xq per sub-block, the blocks' factors d * sc and dmin * m) to float32 rounding (1e-5 of
    the output's scale); each row the same bits alone or in company; within int8 rounding of the float
    product of gguf-py's dequantised W (measured ~5e-3 of the output's scale here; bound 3e-2, and above
    1e-4, so the int8 loop did run). Every other block type: the tests below (all of ggml.BLOCK_KERNEL_TYPES
    run on int8 activations under avx512vnni: test_every_block_type_has_an_int8_loop)."""
    got = run_int8_child(tmp_path, Q4_K_INT8_CHILD, isa=isa)
    assert got["isa"] == isa and got["parse"] and got["alone"], got
    assert got["exact"] < 1e-5, got
    assert 1e-4 < got["vs_f32"] and got["vs_f32_max"] < 3e-2, got


Q6_K_INT8_CHILD = """
import json
import gguf, jax, jax.numpy as jnp, numpy as np
from skippy_zmq.model import ggml, kernel, quant

def q6_k_blocks(rng, n, k):
    # random Q6_K rows [n, k / 256 * 210]: random levels and int8 scales, a modest f16 d of either sign
    raw = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    f = rng.uniform(2.0 ** -12, 2.0 ** -6, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
    raw[..., 208:210] = f.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)

def q6_k_parts(raw, k):
    # per 16-input group d * sc_g [n, k / 16] (float64, exact) and the levels q - 32 [n, k]: per half of
    # 128, weights 0-31 from ql[0:32]'s low nibbles and qh's bits 0-1, 32-63 ql[32:64]'s low and bits 2-3,
    # 64-95 ql[0:32]'s high and bits 4-5, 96-127 ql[32:64]'s high and bits 6-7
    b = raw.reshape(raw.shape[0], k // 256, 210)
    d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float64)
    sc = b[..., 192:208].view(np.int8).astype(np.float64)
    ql = b[..., :128].reshape(*b.shape[:2], 2, 2, 32).astype(np.int64)    # [.., half, ql[0:32] | ql[32:64], 32]
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32).astype(np.int64)
    low = np.concatenate([ql & 15, ql >> 4], 3)                             # [.., half, 4 quarters, 32]
    high = (qh >> (2 * np.arange(4)).reshape(4, 1)) & 3
    lv = ((low | (high << 4)) - 32).reshape(raw.shape[0], k)
    return (d[..., None] * sc).reshape(raw.shape[0], -1), lv

""" + INT8_COMMON + """

def model(x, raw):
    # y = sum_g (d sc_g) xd[g / 2] isum[g], isum exact integers, the rest float64
    scale, lv = q6_k_parts(raw, x.shape[1])
    xq, xd, _ = quantise_x(x)
    isum = np.einsum("mgk,ngk->mng", xq.reshape(len(x), -1, 16), lv.reshape(len(raw), -1, 16))
    return (isum * scale[None] * np.repeat(xd, 2, 1)[:, None]).sum(-1)

dense = jax.jit(ggml.block_dense)
out = {"isa": ISA, **OUT}
rng = np.random.default_rng(0)
for m, k, n in [(1, 256, 37), (2, 512, 50), (3, 1024, 23), (4, 2048, 70), (5, 768, 19), (6, 1536, 41),
                (1, 2048, 300), (4, 1024, 333), (9, 512, 21), (13, 256, 40)]:   # (300, 333: the pool's helpers
    raw = q6_k_blocks(rng, n, k)                                                 # take tasks; 9, 13: prefill-sized)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0                                      # a zero block: step 0
    x[-1, 40] = 6.0                                    # an outlier: its block's other levels coarser
    w = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K), np.float32)
    scale, lv = q6_k_parts(raw, k)                     # (the model's reading of the blocks is gguf-py's)
    out["parse"] &= bool(np.array_equal((np.repeat(scale, 16, 1) * lv).astype(np.float32), w))
    t = ggml.BlockTensor(jnp.asarray(raw), "Q6_K", impl="kernel")
    check(out, dense, x, t, w, model(x, raw))
print(json.dumps(out))
"""


def test_every_block_type_has_an_int8_loop():
    """Under avx512vnni every GGUF block type the kernel reads runs on int8 activations, each with its own
    test in this file; a type added to the block kernel without an int8 loop would run the float loops
    there (tests/test_block_kernel.py checks those on every ISA)."""
    assert sorted(ggml.INT8_BLOCK_TYPES) == sorted(ggml.BLOCK_KERNEL_TYPES)


@pytest.mark.parametrize("isa", [isa for isa, _ in int8_cases("Q6_K")])
def test_q6_k_int8_activation_decode_computes_exactly_what_it_defines(tmp_path, isa):
    """SKIPPY_KERNEL_ISA=avx512vnni (and avx2int8) runs GGUF Q6_K blocks (every M) on int8 activations too: equal to a
    float64 numpy model of that arithmetic (x quantised per 32 inputs as quant_kernel.h says, exact integer
    sums of (q - 32) * xq per 16-input group, the factors d * sc_g * xd) to float32 rounding (1e-5 of the
    output's scale); the model's parse of the blocks bit for bit gguf-py's dequantiser; each row the same bits
    alone, in company, in any order; within int8 rounding of the float product of gguf-py's dequantised W in
    every case (bound 3e-2) and above 1e-4 in every case (so the int8 loop did run)."""
    got = run_int8_child(tmp_path, Q6_K_INT8_CHILD, isa=isa)
    assert got["isa"] == isa and got["parse"] and got["alone"], got
    assert got["exact"] < 1e-5, got
    assert 1e-4 < got["vs_f32"] and got["vs_f32_max"] < 3e-2, got


K23_INT8_CHILD = """
import json
import gguf, jax, jax.numpy as jnp, numpy as np
from skippy_zmq.model import ggml, quant

NBYTES, FACTORS = {"Q3_K": (110, (108,)), "Q2_K": (84, (80, 82))}[KIND]

def blocks(rng, n, k):
    # random rows [n, k / 256 * NBYTES]: random bytes, modest f16 factors of either sign; row 0's first
    # block the extreme one (Q3_K: every level -4, every scale -32; Q2_K: every level 3, scale and min 15)
    raw = rng.integers(0, 256, (n, k // 256, NBYTES), dtype=np.uint8)
    for at in FACTORS:
        f = rng.uniform(2.0 ** -10, 2.0 ** -4, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., at:at + 2] = f.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    raw[0, 0, :FACTORS[0]] = 0 if KIND == "Q3_K" else 255
    return raw.reshape(n, -1)

def parts(raw, k):
    # per 16-input group the factors d * sc_g and dmin * m_g (Q3_K: 0) [n, k / 16] (float64, exact) and the
    # levels [n, k]: weight 128h + 32j + l is bits 2j of qs[32h + l], Q3_K's minus 4 where bit 4h + j of
    # hmask[l] is clear; Q3_K's 6-bit scale g: low 4 bits nibble g // 8 of byte g % 8, high 2 bits
    # 2 (g // 4) of byte 8 + g % 4, minus 32
    b = raw.reshape(raw.shape[0], k // 256, NBYTES)
    qs = b[..., 32:96] if KIND == "Q3_K" else b[..., 16:80]
    j = np.arange(4).reshape(1, 4, 1)
    lv = (qs.reshape(*b.shape[:2], 2, 1, 32).astype(np.int64) >> (2 * j)) & 3           # [.., h, j, l]
    d = b[..., FACTORS[0]:FACTORS[0] + 2].copy().view(np.float16)[..., 0].astype(np.float64)
    if KIND == "Q3_K":
        bit = (b[..., None, None, :32].astype(np.int64) >> (4 * np.arange(2).reshape(2, 1, 1) + j)) & 1
        lv = lv - 4 + 4 * bit
        s = b[..., 96:108].astype(np.int64)
        low = np.concatenate([s[..., :8] & 15, s[..., :8] >> 4], -1)
        high = ((s[..., None, 8:12] >> (2 * np.arange(4)).reshape(4, 1)) & 3).reshape(*b.shape[:2], 16)
        scale, shift = d[..., None] * ((low | high << 4) - 32), np.zeros(b.shape[:2] + (16,))
    else:
        dmin = b[..., 82:84].copy().view(np.float16)[..., 0].astype(np.float64)
        scale, shift = d[..., None] * (b[..., :16] & 15), dmin[..., None] * (b[..., :16] >> 4)
    return scale.reshape(len(raw), -1), shift.reshape(len(raw), -1), lv.reshape(len(raw), k)

""" + INT8_COMMON + """

def model(x, raw):
    # y = sum_g (d sc_g) xd[g / 2] isum[g] - sum_g (dmin m_g) xsum[g], isum exact integers, the rest float64
    scale, shift, lv = parts(raw, x.shape[1])
    xq, xd, _ = quantise_x(x)
    isum = np.einsum("mgk,ngk->mng", xq.reshape(len(x), -1, 16), lv.reshape(len(raw), -1, 16))
    xsum = x.astype(np.float64).reshape(len(x), -1, 16).sum(-1)
    return (isum * scale[None] * np.repeat(xd, 2, 1)[:, None]).sum(-1) - xsum @ shift.T

dense = jax.jit(ggml.block_dense)
out = {"isa": ISA, **OUT}
rng = np.random.default_rng(0)
for m, k, n in [(1, 256, 37), (2, 512, 50), (3, 1024, 23), (4, 2048, 70), (5, 768, 19), (6, 1536, 41),
                (1, 2048, 300), (4, 1024, 333), (9, 512, 21), (13, 256, 40)]:   # (300, 333: the pool's helpers
    raw = blocks(rng, n, k)                                                      # take tasks; 9, 13: prefill-sized)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0                                      # a zero block: step 0
    x[-1, 40] = 6.0                                    # an outlier: its block's other levels coarser
    x[-1, 64:96] = -1.5                                # a block of xq -127 (the products' bound)
    w = np.asarray(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, KIND)), np.float32)
    scale, shift, lv = parts(raw, k)                   # (the model's reading of the blocks is gguf-py's)
    out["parse"] &= bool(np.array_equal((np.repeat(scale, 16, 1) * lv - np.repeat(shift, 16, 1)).astype(np.float32), w))
    t = ggml.BlockTensor(jnp.asarray(raw), KIND, impl="kernel")
    check(out, dense, x, t, w, model(x, raw))
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["Q3_K", "Q2_K"])
def test_q3_k_q2_k_int8_activation_decode_computes_exactly_what_it_defines(tmp_path, kind):
    """SKIPPY_KERNEL_ISA=avx512vnni runs GGUF Q3_K and Q2_K blocks (every M) on int8 activations: equal to a
    float64 numpy model of that arithmetic (x quantised per 32 inputs as quant_kernel.h says, exact integer
    sums of level * xq per 16-input group, the factors d * sc_g * xd; Q2_K's minimums dmin * m_g times x's
    sums per 16) to float32 rounding (1e-5 of the output's scale), extreme blocks included; the model's parse
    of the blocks bit for bit gguf-py's dequantiser; each row the same bits alone, in company, in any order;
    within int8 rounding of the float product of gguf-py's dequantised W in every case (bound 3e-2) and above
    1e-4 in every case (so the int8 loop did run)."""
    got = run_int8_child(tmp_path, f"KIND = {kind!r}\n" + K23_INT8_CHILD)
    assert got["isa"] == "avx512vnni" and got["parse"] and got["alone"], got
    assert got["exact"] < 1e-5, got
    assert 1e-4 < got["vs_f32"] and got["vs_f32_max"] < 3e-2, got


IQ4_INT8_CHILD = """
import json
import gguf, jax, jax.numpy as jnp, numpy as np
from skippy_zmq.model import ggml, quant

def iq4_blocks(rng, kind, n, k):
    # random rows [n, k / block * bytes]: random index and scale bytes, a modest f16 d of either sign
    t = ggml.TYPES[kind]
    raw = rng.integers(0, 256, (n, k // t.block, t.nbytes), dtype=np.uint8)
    f = rng.uniform(2.0 ** -12, 2.0 ** -6, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
    raw[..., 0:2] = f.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)

def iq4_parts(raw, kind, k):
    # per 32 inputs the float factor (IQ4_XS: d * (ls - 32), ls 6 bits, 4 in scales_l's nibble j % 2 of byte
    # j / 2, 2 in scales_h's bits 2j; IQ4_NL: d) [n, k / 32], float64 (exact), and the levels [n, k]: per 32,
    # kvalues of 16 index bytes' low nibbles, then of their high ones
    t = ggml.TYPES[kind]
    b = raw.reshape(raw.shape[0], k // t.block, t.nbytes)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if kind == "IQ4_XS":
        high = b[..., 2:4].copy().view("<u2")[..., 0].astype(np.int64)
        low = b[..., 4:8].astype(np.int64)
        j = np.arange(8)
        ls = ((low[..., j // 2] >> (4 * (j % 2))) & 15) | (((high[..., None] >> (2 * j)) & 3) << 4)
        scale, qs = d[..., None] * (ls - 32), b[..., 8:].reshape(*b.shape[:2], 8, 16)
    else:
        scale, qs = d[..., None], b[..., 2:].reshape(*b.shape[:2], 1, 16)
    index = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)
    lv = np.asarray(ggml.IQ4_VALUES, np.int64)[index].reshape(raw.shape[0], k)
    return scale.reshape(raw.shape[0], -1), lv

""" + INT8_COMMON + """

def model(x, raw, kind):
    # y = sum_s scale_s xd[s] isum[s] over the 32-input blocks s, isum exact integers, the rest float64
    scale, lv = iq4_parts(raw, kind, x.shape[1])
    xq, xd, _ = quantise_x(x)
    isum = np.einsum("msk,nsk->mns", xq, lv.reshape(len(raw), -1, 32))
    return (isum * scale[None] * xd[:, None]).sum(-1)

dense = jax.jit(ggml.block_dense)
out = {"isa": ISA, **OUT}
rng = np.random.default_rng(0)
for m, k, n in SHAPES:
    raw = iq4_blocks(rng, KIND, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0                                      # a zero block: step 0
    x[-1, k // 2 + 8] = 6.0                            # an outlier: its block's other levels coarser
    w = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[KIND]), np.float32)
    scale, lv = iq4_parts(raw, KIND, k)                # (the model's reading of the blocks is gguf-py's)
    out["parse"] &= bool(np.array_equal((np.repeat(scale, 32, 1) * lv).astype(np.float32), w))
    t = ggml.BlockTensor(jnp.asarray(raw), KIND, impl="kernel")
    check(out, dense, x, t, w, model(x, raw, KIND))
print(json.dumps(out))
"""

# (M, K, N) per type: M 1-13 (the 4-, 2- and 1-row tiles, prefill-sized calls; N 300 and 333: the pool's
# helpers take tasks); IQ4_NL's K also 32 to 576, 1 to 7 blocks past a multiple of its 8-block step
IQ4_SHAPES = {"IQ4_XS": [(1, 256, 37), (2, 512, 50), (3, 1024, 23), (4, 2048, 70), (5, 768, 19), (6, 1536, 41),
                         (1, 2048, 300), (4, 1024, 333), (9, 512, 21), (13, 256, 40)],
              "IQ4_NL": [(3, 32, 37), (2, 96, 50), (3, 576, 23), (4, 2048, 70), (5, 160, 19), (6, 1536, 41),
                         (1, 2048, 300), (4, 576, 333), (9, 224, 21), (13, 96, 40), (7, 64, 9), (2, 128, 17), (3, 448, 11)]}


@pytest.mark.parametrize("kind", ["IQ4_XS", "IQ4_NL"])
def test_iq4_int8_activation_loops_compute_exactly_what_they_define(tmp_path, kind):
    """SKIPPY_KERNEL_ISA=avx512vnni runs GGUF IQ4_XS and IQ4_NL blocks (every M) on int8 activations:
    equal to a float64 numpy model of that arithmetic (x quantised per 32 inputs as quant_kernel.h says, exact
    integer sums of kvalues[q] * xq per 32-input block, the factors d * (ls - 32) * xd or d * xd) to float32
    rounding (1e-5 of the output's scale); the model's parse of the blocks bit for bit gguf-py's dequantiser;
    each row the same bits alone, in company, in any order; within int8 rounding of the float product of
    gguf-py's dequantised W in every case (bound 3e-2) and above 1e-4 in every case (so the int8 loop did
    run). IQ4_NL's K need not be a multiple of 256: the last 1-7 blocks of a row take the masked step."""
    got = run_int8_child(tmp_path, f"KIND = {kind!r}\nSHAPES = {IQ4_SHAPES[kind]!r}\n" + IQ4_INT8_CHILD)
    assert got["isa"] == "avx512vnni" and got["parse"] and got["alone"], got
    assert got["exact"] < 1e-5, got
    assert 1e-4 < got["vs_f32"] and got["vs_f32_max"] < 3e-2, got


BLOCKS_INT8_CHILD = """
import json, sys
import gguf, jax, jax.numpy as jnp, numpy as np
from skippy_zmq.model import ggml, kernel, quant

KIND = sys.argv[1]
NBYTES = {"Q8_0": 34, "Q5_1": 24, "Q5_0": 22, "Q5_K": 176}[KIND]
BLOCK = 256 if KIND == "Q5_K" else 32

def f16(a):
    return a.copy().view(np.float16)[..., 0].astype(np.float64)

def blocks(rng, n, k):
    # random rows [n, k / BLOCK * NBYTES]: random bytes, the f16 factors modest, of either sign
    raw = rng.integers(0, 256, (n, k // BLOCK, NBYTES), dtype=np.uint8)
    for at in ((0,) if KIND in ("Q8_0", "Q5_0") else (0, 2)):
        f = rng.uniform(2.0 ** -10, 2.0 ** -4, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., at:at + 2] = f.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if KIND == "Q8_0":
        raw[0, 0, 2:] = 0x80                           # the extremes: q = -128 and 127 against xq = +-127
        raw[-1, -1, 2:] = 0x7F
    return raw.reshape(n, -1)

def parts(raw, k):
    # the factor and the offset per 32-weight block [n, k / 32] (float64, exact) and the levels [n, k],
    # weight = scale * level - shift
    n = raw.shape[0]
    b = raw.reshape(n, k // BLOCK, NBYTES)
    if KIND == "Q8_0":                                 # d, int8 q
        return f16(b[..., 0:2]), np.zeros((n, k // 32)), b[..., 2:].view(np.int8).astype(np.int64).reshape(n, k)
    if KIND in ("Q5_1", "Q5_0"):                       # d, (Q5_1: m,) u32 qh (bit i: weight i's fifth), qs: 0-15 low, 16-31 high
        at = 4 if KIND == "Q5_1" else 2
        qh = b[..., at:at + 4].copy().view("<u4").astype(np.int64)
        qs = b[..., at + 4:].astype(np.int64)
        lv = np.concatenate([qs & 15, qs >> 4], -1) | (((qh >> np.arange(32)) & 1) << 4)
        if KIND == "Q5_0":                             # w = d (q - 16)
            return f16(b[..., 0:2]), np.zeros((n, k // 32)), (lv - 16).reshape(n, k)
        return f16(b[..., 0:2]), -f16(b[..., 2:4]), lv.reshape(n, k)
    d, dmin = f16(b[..., 0:2]), f16(b[..., 2:4])       # Q5_K: Q4_K's factors, qh[32] at 16, qs[128] at 48
    q = b[..., 4:16].astype(np.int64)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 48:].reshape(n, -1, 4, 32).astype(np.int64)
    low = np.stack([qs & 15, qs >> 4], 3).reshape(n, -1, 8, 32)     # sub-block 2j: chunk j's low nibbles
    qh = b[..., 16:48].astype(np.int64)[:, :, None, :]              # bit s of qh[l]: weight l of sub-block s
    lv = low | (((qh >> np.arange(8).reshape(8, 1)) & 1) << 4)
    return (d[..., None] * sc).reshape(n, -1), (dmin[..., None] * mn).reshape(n, -1), lv.reshape(n, k)

""" + INT8_COMMON + """

def model(x, raw):
    # y = sum_b scale_b xd[b] isum[b] - sum_b shift_b xs[b], isum exact integers, the rest float64
    scale, shift, lv = parts(raw, x.shape[1])
    xq, xd, xs = quantise_x(x)
    isum = np.einsum("mbk,nbk->mnb", xq, lv.reshape(len(raw), -1, 32))
    return (isum * scale[None] * xd[:, None]).sum(-1) - xs @ shift.T

dense = jax.jit(ggml.block_dense)
out = {"isa": ISA, **OUT}
rng = np.random.default_rng(0)
shapes = [(1, 256, 37), (2, 512, 50), (3, 1024, 23), (4, 2048, 70), (5, 768, 19), (6, 1536, 41),
          (1, 2048, 300), (4, 1024, 333), (9, 512, 21), (13, 256, 40)]   # (300, 333: the pool's helpers take tasks)
if BLOCK == 32:                                        # K not a multiple of 256: the blocks one at a time
    shapes += [(1, 576, 45), (4, 576, 30), (7, 96, 17), (3, 32, 9), (13, 288, 11)]
for m, k, n in shapes:
    raw = blocks(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0                                      # a zero block: step 0
    x[-1, 40 % k] = 6.0                                # an outlier: its block's other levels coarser
    x[0, -32:] = 1.0                                   # xq = 127 throughout a block
    w = np.asarray(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, KIND)), np.float32)
    scale, shift, lv = parts(raw, k)                   # (the model's reading of the blocks is gguf-py's)
    blk = lambda f: np.repeat(f, 32, 1)
    out["parse"] &= bool(np.array_equal((blk(scale) * lv - blk(shift)).astype(np.float32), w))
    t = ggml.BlockTensor(jnp.asarray(raw), KIND, impl="kernel")
    check(out, dense, x, t, w, model(x, raw))
print(json.dumps(out))
"""


@pytest.mark.parametrize("isa, kind", int8_cases("Q8_0", "Q5_K", "Q5_1", "Q5_0"))
def test_more_blocks_int8_activation_computes_exactly_what_it_defines(tmp_path, isa, kind):
    """SKIPPY_KERNEL_ISA=avx512vnni (avx2int8: all but Q5_1) runs GGUF Q8_0, Q5_K, Q5_1 and Q5_0 blocks (every M) on int8 activations
    as well: equal to a float64 numpy model of that arithmetic (x quantised per 32 inputs as quant_kernel.h
    says, exact integer sums of level * xq per 32 weights (Q8_0's q, Q5_0's q - 16: signed), the blocks'
    factors times xd, the offsets dmin * m (Q5_K) or m (Q5_1) times x's exact block sums) to float32 rounding (1e-5 of the output's scale); the
    model's parse of the blocks bit for bit gguf-py's dequantiser; each row the same bits alone, in company,
    in any order (M up to 13: the 4-, 2- and 1-row tiles); K not a multiple of 256 for the 32-weight types
    (576, 288, 96, 32: the blocks a 256-step leaves); within int8 rounding of the float product of gguf-py's
    dequantised W in every case (bound 3e-2) and above 1e-4 in every case (so the int8 loop did run)."""
    got = run_int8_child(tmp_path, BLOCKS_INT8_CHILD, kind, isa=isa)
    assert got["isa"] == isa and got["parse"] and got["alone"], got
    assert got["exact"] < 1e-5, got
    assert 1e-4 < got["vs_f32"] and got["vs_f32_max"] < 3e-2, got
