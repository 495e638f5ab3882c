"""The native quantised-matmul kernel as a dependency: built into a user cache
(never the source tree), one library with per-ISA loops picked at load time,
SKIPPY_KERNEL_ISA forcing a path, and exactly one warning plus the XLA
fallback when no compiler exists. Each case runs in a fresh interpreter,
since the kernel is loaded once per process."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq.model import quant

REPO = Path(__file__).resolve().parent.parent
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
print(json.dumps({"available": quant.kernel_available(), "isa": quant.kernel_isa(), "worst": worst}))
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
    """SKIPPY_KERNEL_ISA=avx2 runs the AVX2 loops even on an AVX-512 CPU (as CI's is)."""
    if not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip("no C++ compiler")
    if isa == "avx2" and not (X86 and {"avx2", "fma", "f16c"} <= cpu_flags()):
        pytest.skip("this CPU has no AVX2")
    got, _ = run_child(tmp_path, FULL, SKIPPY_KERNEL_ISA=isa)
    assert got["available"] and got["isa"] == isa
    assert got["worst"] < 1e-5


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
    assert got["isa"] == best and got["worst"] < 1e-5
    got, stderr = run_child(tmp_path, SKIPPY_KERNEL_ISA="sse9")
    assert got["isa"] == best and "SKIPPY_KERNEL_ISA=sse9 is unknown or not supported" in stderr


def test_no_compiler_means_the_xla_fallback_and_exactly_one_warning(tmp_path):
    cache = tmp_path / "empty-cache"
    got, stderr = run_child(tmp_path, CXX=str(tmp_path / "no-such-compiler"), SKIPPY_KERNEL_CACHE=str(cache))
    assert got == {"available": False, "isa": None, "worst": got["worst"]} and got["worst"] < 1e-5
    warnings = [line for line in stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, stderr
    assert "CPU kernel unavailable, using the slow XLA fallback" in warnings[0]
    assert "no C++ compiler" in warnings[0] and "no-such-compiler" in warnings[0]
    assert not cache.exists()


def test_fresh_build_lands_in_the_cache_dir_never_the_source_tree(tmp_path):
    if not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip("no C++ compiler")
    cache = tmp_path / "cache"
    got, _ = run_child(tmp_path, SKIPPY_KERNEL_CACHE=str(cache))
    assert got["available"] and got["worst"] < 1e-5
    built = sorted(p.name for p in cache.iterdir())
    assert len(built) == 1 and built[0].startswith(f"quant_kernel-{platform.machine()}-{'+'.join(quant.kernel_isas())}-")
    assert built[0].endswith(".so")
    package = REPO / "skippy_zmq" / "model"
    assert not [p for p in package.iterdir() if p.suffix in (".so", ".o")]


def test_avx2_loops_hold_no_avx512_instruction_and_share_no_symbol(tmp_path):
    """Compile the loops as the AVX2 variant is built and read the code: no zmm, no mask
    or upper-16 vector register, so the AVX2 path can run on an AVX2-only CPU; and the
    object exports its two entry points only (no weak inline copy the linker could hand
    to another ISA's caller)."""
    cxx = shutil.which(os.environ.get("CXX") or "g++")
    if not (X86 and cxx and shutil.which("objdump") and shutil.which("nm")):
        pytest.skip("needs x86-64, a C++ compiler and binutils")
    obj = tmp_path / "avx2.o"
    subprocess.run([cxx, *quant.CXX_FLAGS, *quant.ISA_FLAGS["avx2"], "-DSKIPPY_ISA=avx2", "-c",
                    str(quant.KERNEL_DIR / "quant_kernel_isa.cc"), "-o", str(obj)], check=True, timeout=300)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True, capture_output=True,
                         text=True).stdout
    assert "ymm" in asm                                          # it is vectorised
    assert not re.search(r"zmm|%k[0-7]|[xy]mm(1[6-9]|2[0-9]|3[01])", asm)
    symbols = subprocess.run(["nm", "--extern-only", "--defined-only", str(obj)], check=True, capture_output=True,
                             text=True).stdout.split()
    assert sorted(symbols[2::3]) == ["skippy_int8_panel_avx2", "skippy_q4_panel_avx2"]
