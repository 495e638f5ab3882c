"""The llama.cpp a user deploys, built here: `llama-server`, `llama-bench`, `llama-quantize` and
`rpc-server` from the llama.cpp that the llama-cpp-python sdist on PyPI vendors (`vendor/llama.cpp`),
CPU only, for the CPU it is built on.

    skippy-zmq bench peers --build        (or `make peers`)

Built once into a cache outside the repository (`$SKIPPY_PEERS_DIR`, default
`~/.cache/skippy_zmq/llama.cpp-<version>`), with `cmake` and `ninja` from PyPI (the `peers-build`
extra); about 10-15 minutes on 2 cores. `build.json` there records what was built, how and how
long it took; a later call reuses the binaries when they were built with the options this host
wants now (`host_options`), and rebuilds otherwise.

The ISA: `GGML_NATIVE` (`-march=native`), unless the CPU advertises AMX and a probe finds AMX unusable;
then every x86 extension the CPU lists except AMX, named one by one. The probe is ggml's own AMX
start-up compiled as ggml is (`-O3 -march=native`, the same C++ compiler) and run: ask the kernel for
tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), load a tile config built on the
stack, `tilezero`. It fails where the kernel does not grant AMX and also where the compiler drops the
config's stores before `ldtilecfg` (GCC 12 does, at -O2 and above): either way ggml's AMX kernels
would die at the first matrix product with SIGILL.

`SKIPPY_PEERS_ISA=avx2` builds llama.cpp as an AVX2-only host runs it (AVX2, FMA, F16C, BMI2, no
AVX-512, no AMX: the extensions named one by one) into its own folder (`<cache>-avx2`), so one AVX-512
machine measures both CPU classes: beside `SKIPPY_KERNEL_ISA=avx2` for ours.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

SDIST_VERSION = "0.3.36"
# tool name -> the binary CMake writes (the RPC server's target is ggml-rpc-server)
BINARIES = {"llama-server": "llama-server", "llama-bench": "llama-bench", "llama-quantize": "llama-quantize",
            "rpc-server": "ggml-rpc-server"}
# CPU only, no network at build or run time (no HTTPS client, no prebuilt web UI fetched from the Hub)
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release", "GGML_RPC": "ON", "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_OPENSSL": "OFF", "GGML_OPENMP": "ON",
}
# ggml's x86 options (ggml/CMakeLists.txt) -> the /proc/cpuinfo flags each needs, for a build without
# -march=native; GGML_AVX512 compiles with -mavx512{f,cd,vl,dq,bw}
X86_OPTIONS = {
    "GGML_SSE42": ("sse4_2",), "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",), "GGML_F16C": ("f16c",), "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",), "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# what an AVX2-only x86 host builds (SKIPPY_PEERS_ISA=avx2): the extensions Haswell to Zen 3 share
AVX2_OPTIONS = ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C")
PEERS_ISA_ENV = "SKIPPY_PEERS_ISA"   # native (default) | avx2
PEERS_ISAS = ("native", "avx2")
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
# ggml_amx_init and ggml_tile_config_init (ggml-cpu/amx/{amx,mmq}.cpp) in one program; exit 0: AMX runs
AMX_PROBE = r"""
#include <cstdint>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
struct tile_config_t { uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved_0[14] = {0};
                       uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };
__attribute__((noinline)) static void tile_config_init() {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    for (int t = 0; t < 8; ++t) { tc.rows[t] = t < 2 ? 8 : 16; tc.colsb[t] = t == 2 || t == 3 ? 32 : 64; }
    _tile_loadconfig(&tc);
}
int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 3;
    tile_config_init();
    _tile_zero(4);
    _tile_release();
    return 0;
}
"""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's `flags` in /proc/cpuinfo (empty off Linux/x86)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def amx_probe(cxx: str | None = None) -> tuple[bool, str]:
    """(AMX runs as ggml runs it, what the probe saw): AMX_PROBE compiled with cxx (default $CXX, else c++)
    and run in a child process, so a SIGILL ends the child and not us."""
    cxx = cxx or os.environ.get("CXX") or shutil.which("c++") or "g++"
    with tempfile.TemporaryDirectory(prefix="amx-probe-") as tmp:
        src, exe = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        src.write_text(AMX_PROBE)
        try:
            cc = subprocess.run([cxx, "-O3", "-march=native", str(src), "-o", str(exe)],
                                capture_output=True, text=True, timeout=120)
            if cc.returncode != 0:
                return False, f"{cxx} cannot compile the probe: {cc.stderr.strip()[-200:]}"
            rc = subprocess.run([str(exe)], capture_output=True, timeout=30).returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"probe did not run: {exc}"
    if rc == 0:
        return True, f"tilezero ran ({cxx} -O3 -march=native)"
    if rc == 3:
        return False, "the kernel refused ARCH_REQ_XCOMP_PERM for XTILEDATA"
    died = signal.Signals(-rc).name if -rc in set(signal.Signals) else f"exit {rc}"
    return False, f"the tile config did not take ({died}; built with {cxx} -O3 -march=native)"


def isa_options(flags: frozenset[str] | set[str], amx_usable: bool, isa: str = "native") -> dict[str, str]:
    """The ISA options for a CPU with these cpuinfo flags: -march=native where that is safe (no AMX
    advertised, or AMX runs); else each extension the CPU lists, by name, and AMX off. isa="avx2":
    only AVX2_OPTIONS (those the CPU lists), every other extension and AMX off."""
    if isa == "avx2":
        named = {opt: "ON" if opt in AVX2_OPTIONS and all(f in flags for f in need) else "OFF"
                 for opt, need in X86_OPTIONS.items()}
        return {"GGML_NATIVE": "OFF", **named, **{opt: "OFF" for opt in AMX_OPTIONS}}
    if amx_usable or not any(f in flags for f in AMX_FLAGS):
        return {"GGML_NATIVE": "ON"}
    named = {opt: "ON" if all(f in flags for f in need) else "OFF" for opt, need in X86_OPTIONS.items()}
    return {"GGML_NATIVE": "OFF", **named, **{opt: "OFF" for opt in AMX_OPTIONS}}


def peers_isa() -> str:
    """$SKIPPY_PEERS_ISA: native (default: this CPU's best) or avx2 (as an AVX2-only host builds it)."""
    isa = os.environ.get(PEERS_ISA_ENV, "").strip().lower() or "native"
    if isa not in PEERS_ISAS:
        raise SystemExit(f"{PEERS_ISA_ENV}={isa!r} is not one of {', '.join(PEERS_ISAS)}")
    return isa


def host_options() -> tuple[dict[str, str], dict[str, Any]]:
    """This host's cmake options (CMAKE_OPTIONS plus isa_options for peers_isa) and what decided them (for
    build.json); the probe runs only where a native build is asked for and the CPU advertises AMX."""
    flags, isa = cpu_flags(), peers_isa()
    advertised = sorted(f for f in AMX_FLAGS if f in flags)
    usable, seen = amx_probe() if advertised and isa == "native" else (False, "no AMX advertised" if not advertised
                                                                        else f"not probed ({PEERS_ISA_ENV}={isa})")
    options = isa_options(flags, usable, isa)
    return {**CMAKE_OPTIONS, **options}, {"peers_isa": isa, "amx_advertised": advertised, "amx_usable": usable,
                                          "amx_probe": seen}


def cache_dir(isa: str | None = None) -> Path:
    """Where the peers of `isa` (default peers_isa()) are built: $SKIPPY_PEERS_DIR or
    ~/.cache/skippy_zmq/llama.cpp-<version>, with -avx2 after it for the AVX2-only build."""
    env = os.environ.get("SKIPPY_PEERS_DIR")
    base = Path(env) if env else Path.home() / ".cache" / "skippy_zmq" / f"llama.cpp-{SDIST_VERSION}"
    isa = isa or peers_isa()
    return base if isa == "native" else base.with_name(f"{base.name}-{isa}")


def binary_paths(root: Path) -> dict[str, Path]:
    return {tool: root / "build" / "bin" / name for tool, name in BINARIES.items()}


def built(root: Path | None = None, options: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The record of a finished build with these cmake options (default: host_options) whose binaries
    are all there, else None: a build made for other options (an older flag set, another CPU) is stale."""
    root = root or cache_dir()
    try:
        record = json.loads((root / "build.json").read_text())
    except (OSError, ValueError):
        return None
    paths = binary_paths(root)
    if record.get("version") != SDIST_VERSION or not all(p.is_file() for p in paths.values()):
        return None
    if record.get("options") != (options if options is not None else host_options()[0]):
        return None
    return {**record, "binaries": {tool: str(p) for tool, p in paths.items()}}


def configure_command(cmake: str, ninja: str, source: Path, build: Path, options: dict[str, str]) -> list[str]:
    return [cmake, "-S", str(source), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
            *(f"-D{k}={v}" for k, v in options.items())]


def build_command(cmake: str, build: Path, jobs: int) -> list[str]:
    return [cmake, "--build", str(build), "-j", str(jobs), "--target", *BINARIES.values()]


def _tool(name: str) -> str:
    """cmake / ninja from this environment (the `peers-build` extra); installed from PyPI if absent."""
    here = Path(sys.executable).parent / name
    if not here.is_file():
        print(f"[peers] installing {name} from PyPI into {sys.prefix}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", name], check=True)
    if not here.is_file():
        raise SystemExit(f"{name} is not in {here.parent} after pip install; install the peers-build extra")
    return str(here)


def sdist(root: Path | None = None) -> Path:
    """The llama-cpp-python sdist under root/sdist, downloaded there (pip, from PyPI) if absent;
    raises CalledProcessError where pip cannot get it (no network). The one copy every user of the
    sdist reads (the peers build, llama.cpp's server tests, its models/ folder for the suite): the
    suite's parallel workers ask at once, so one downloads (under a lock, into a staging folder,
    renamed in whole) while the others wait and find it."""
    download = (root or cache_dir("native")) / "sdist"
    archive = download / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if archive.is_file():
        return archive
    download.mkdir(parents=True, exist_ok=True)
    with open(download / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if archive.is_file():
            return archive
        print(f"[peers] downloading the llama-cpp-python {SDIST_VERSION} sdist", flush=True)
        with tempfile.TemporaryDirectory(dir=download, prefix=".pip-") as staging:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={SDIST_VERSION}", "-d", staging], check=True)
            os.replace(Path(staging) / archive.name, archive)
    return archive


def _source(root: Path) -> Path:
    """vendor/llama.cpp of the sdist, downloaded (pip, from PyPI) and unpacked under root once."""
    source = root / "src" / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    archive = sdist(None if root == cache_dir() else root)   # the default folders share one download
    with tarfile.open(archive) as tar:
        tar.extractall(root / "src", filter="data")
    if not (source / "CMakeLists.txt").is_file():
        raise SystemExit(f"{archive} has no vendor/llama.cpp")
    return source


def build(root: Path | None = None, jobs: int | None = None, force: bool = False) -> dict[str, Any]:
    """Build the peers (or find the finished build) and return build.json's record with binary paths."""
    root = root or cache_dir()
    options, host = host_options()
    if not force and (record := built(root, options)):
        print(f"[peers] reusing the build in {root} ({record['seconds']:.0f} s on {record['built']})", flush=True)
        return record
    jobs = jobs or os.cpu_count() or 2
    cmake, ninja = _tool("cmake"), _tool("ninja")
    source = _source(root)
    out = root / "build"
    # a fresh tree for a new option set: CMakeCache.txt would keep options this configure does not name
    shutil.rmtree(out, ignore_errors=True)
    print(f"[peers] building {', '.join(BINARIES)} from {source} with {jobs} jobs, {PEERS_ISA_ENV}="
          f"{host['peers_isa']}, GGML_NATIVE={options['GGML_NATIVE']} (AMX: {host['amx_probe']}); about 10-15 minutes on 2 cores; "
          f"log: {root / 'build.log'}", flush=True)
    t0 = time.monotonic()
    with open(root / "build.log", "w") as log:
        for cmd in (configure_command(cmake, ninja, source, out, options), build_command(cmake, out, jobs)):
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"llama.cpp build failed; see {root / 'build.log'}")
    seconds = time.monotonic() - t0
    cmake_version = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    record = {"version": SDIST_VERSION, "seconds": round(seconds, 1), "jobs": jobs,
              "built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
              "cmake": cmake_version, "options": options, "host": host}
    (root / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[peers] built in {seconds / 60:.1f} min into {out / 'bin'}", flush=True)
    return built(root, options) or record
