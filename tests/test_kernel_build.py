"""The native kernel a stage builds on a fresh machine: only the loops this CPU runs (the pick of
SKIPPY_KERNEL_ISA, and generic), so its first start waits for 7 compiler runs instead of 13
(model/kernel.py kernel_isas); SKIPPY_KERNEL_BUILD=all builds every set, as the tests' conftest asks.
`skippy-zmq build-kernel` (make install) builds it into the installation, where a stage looks first;
a build there for another CPU's sets, or one another user could have written, is passed over."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq.model import kernel

REPO = Path(__file__).resolve().parent.parent
AVX512 = kernel.CPU_FLAGS["avx512"] | {"sse4_2"}
VNNI = kernel.CPU_FLAGS["avx512vnni"]
AVX2 = kernel.CPU_FLAGS["avx2"]


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(kernel.BUILD_ENV, raising=False)
    monkeypatch.delenv(kernel.ISA_ENV, raising=False)
    return monkeypatch


@pytest.mark.parametrize("flags, isa, built", [
    (AVX512, None, ("avx512", "generic")),
    (AVX512, "auto", ("avx512", "generic")),
    (VNNI, None, ("avx512", "generic")),                       # auto never picks int8 activations
    (VNNI, "avx512vnni", ("avx512vnni", "avx512", "generic")),   # ... a name does, auto's kept as fallback
    (AVX512, "avx2", ("avx512", "avx2", "generic")),
    (AVX512, "avx512vnni", ("avx512", "generic")),             # not on this CPU: not built
    (AVX2, None, ("avx2", "generic")),
    (set(), None, ("generic",)),
    (AVX512, "no-such-isa", ("avx512", "generic"))])
def test_a_stage_builds_the_loops_this_cpu_runs_and_generic(x86, flags, isa, built):
    x86.setattr(kernel, "_cpu_flags", lambda: flags)
    if isa is not None:
        x86.setenv(kernel.ISA_ENV, isa)
    assert kernel.kernel_isas() == built


def test_every_set_when_asked_or_when_the_cpu_cannot_be_read(x86):
    x86.setattr(kernel, "_cpu_flags", lambda: AVX512)
    x86.setenv(kernel.BUILD_ENV, "all")
    assert kernel.kernel_isas() == tuple(kernel.ISA_FLAGS)
    x86.delenv(kernel.BUILD_ENV)
    x86.setattr(kernel, "_cpu_flags", lambda: None)
    assert kernel.kernel_isas() == tuple(kernel.ISA_FLAGS)


def test_other_cpus_build_generic_only(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert kernel.kernel_isas() == ("generic",)


CHILD = """
import json
import numpy as np, jax, jax.numpy as jnp
from skippy_zmq.model import kernel, quant
w = np.random.default_rng(0).standard_normal((256, 96)).astype(np.float32)
x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
got = {impl: np.asarray(quant.dense(jnp.asarray(x), jax.tree.map(jnp.asarray, quant.to_qtensor(w, impl, 4))))
       for impl in ("kernel", "xla")}
print(json.dumps({"isa": quant.kernel_isa(), "built": kernel.kernel_isas(), "supported": quant.supported_isas(),
                  "worst": float(np.abs(got["kernel"] - got["xla"]).max())}))
"""


def test_a_fresh_build_of_this_cpus_loops_links_loads_and_matches_the_xla_path(tmp_path):
    """The glue built without the other sets' loops (-DSKIPPY_NO_<isa>) links, loads (every symbol
    resolved: ctypes loads with RTLD_NOW) and runs auto's loops, with the XLA path's results; the
    library lands in the cache folder, never in the source tree."""
    if not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip("no C++ compiler")
    cache = tmp_path / "cache"
    got = run_child(tmp_path, cache, tmp_path / "nothing-installed")   # the fallback: built in the cache
    built = tuple(got["built"])
    assert built[-1] == "generic" and got["isa"] == built[0] and got["supported"] == list(built)
    assert [p.name.split("-")[2] for p in cache.glob("*.so")] == ["+".join(built)]
    assert got["worst"] < 1e-3, got
    [only] = cache.iterdir()   # the library alone, named for the machine and the loops it holds
    assert only.name.startswith(f"quant_kernel-{platform.machine()}-{'+'.join(built)}-") and only.suffix == ".so"
    assert not [p for p in (REPO / "skippy_zmq" / "model").iterdir() if p.suffix in (".so", ".o")]


def run_child(tmp_path: Path, cache: Path, installed: Path, **extra: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", kernel.CACHE_ENV: str(cache), kernel.BUILD_ENV: "here",
           kernel.ISA_ENV: "auto", kernel.INSTALL_ENV: str(installed), "PYTHONPATH": str(REPO), **extra}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_build_kernel_installs_it_and_a_stage_loads_it_from_there_building_nothing(tmp_path):
    """make install's step: the library lands in the install folder (0755: other users may load it),
    and a process with an empty cache loads it from there (its cache stays empty), even where no
    compiler is left (an image that removed it after install)."""
    if not shutil.which(os.environ.get("CXX") or "g++"):
        pytest.skip("no C++ compiler")
    installed = tmp_path / "venv" / "share" / "skippy_zmq" / "kernel"
    env = {**os.environ, kernel.BUILD_ENV: "here", kernel.ISA_ENV: "auto", kernel.INSTALL_ENV: str(installed),
           kernel.CACHE_ENV: str(tmp_path / "install-time-cache"), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "build-kernel"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [built] = installed.glob("*.so")
    assert out.stdout.strip() == str(built) and oct(installed.stat().st_mode & 0o777) == "0o755"
    cache = tmp_path / "cache"
    got = run_child(tmp_path, cache, installed, CXX=str(tmp_path / "no-such-compiler"))
    assert built.name.split("-")[2] == "+".join(got["built"]) and got["isa"] == got["built"][0]
    assert got["worst"] < 1e-3, got
    assert not list(cache.glob("*.so")) and not (tmp_path / "install-time-cache").exists()


@pytest.fixture
def installed(tmp_path, x86):
    """An install folder, the CPU read as AVX-512 and the compiler's identity fixed (no compiler runs)."""
    x86.setattr(kernel, "_cpu_flags", lambda: AVX512)
    x86.setenv(kernel.INSTALL_ENV, str(tmp_path / "kernel"))
    (tmp_path / "kernel").mkdir(mode=0o755)
    return tmp_path / "kernel"


IDENT = [*kernel.CXX_FLAGS, "/include", "0.0"]


def plant(folder: Path, isas: tuple[str, ...]) -> Path:
    lib = folder / kernel._kernel_name(IDENT, isas)
    lib.write_bytes(b"a library")
    lib.chmod(0o755)
    return lib


def test_the_installed_build_of_this_cpus_sets_or_of_every_set_is_found(installed):
    assert kernel._installed_kernel(IDENT, ("avx512", "generic")) is None          # nothing installed
    every = plant(installed, tuple(kernel.ISA_FLAGS))
    assert kernel._installed_kernel(IDENT, ("avx512", "generic")) == every         # serves any x86 CPU
    mine = plant(installed, ("avx512", "generic"))
    assert kernel._installed_kernel(IDENT, ("avx512", "generic")) == mine


def test_an_installed_build_for_another_cpu_or_other_sources_is_passed_over(installed):
    plant(installed, ("avx2", "generic"))                       # built on a worker with AVX2 only
    assert kernel._installed_kernel(IDENT, ("avx512", "generic")) is None
    plant(installed, ("avx512", "generic")).rename(installed / "quant_kernel-x86_64-avx512+generic-0000.so")
    assert kernel._installed_kernel(IDENT, ("avx512", "generic")) is None          # stale sources: another key


def test_an_installed_build_others_could_write_is_not_loaded(installed):
    lib = plant(installed, ("avx512", "generic"))
    lib.chmod(0o775)
    assert kernel._installed_kernel(IDENT, ("avx512", "generic")) is None
    lib.chmod(0o755)
    installed.chmod(0o777)
    assert kernel._installed_kernel(IDENT, ("avx512", "generic")) is None
    installed.chmod(0o755)
    lib.unlink()
    lib.symlink_to(installed.parent / "elsewhere.so")
    assert kernel._installed_kernel(IDENT, ("avx512", "generic")) is None
