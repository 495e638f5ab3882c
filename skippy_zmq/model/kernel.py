"""The native CPU kernel (quant_kernel*.cc, through the XLA FFI): built once per machine and source,
cached under a name keyed by its sources, ISAs, compiler and flags (a source change rebuilds it),
loaded and registered once per process, its instruction set picked at run time (SKIPPY_KERNEL_ISA).
model/quant.py calls it for QTensor matmuls, MoE experts and decode attention; docs/models.md
("The native kernel") says how it is built and dispatched.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
from loguru import logger

from skippy_zmq.files.private_dirs import private_cache_dir, unsafe_reason

KERNEL_TARGETS = {8: "skippy_int8_dense", 4: "skippy_q4_dense", 5: "skippy_q5_dense"}   # bits -> FFI target
MOE_TARGETS = {8: "skippy_int8_moe_ffn", 4: "skippy_q4_moe_ffn"}   # an MoE layer's routed experts in one call
ATTEND_TARGET = "skippy_decode_attention"   # one query token per row over f32 KV (quant_kernel.h)
BLOCK_TARGET = "skippy_block_dense"         # GGUF blocks read in place (ggml.BLOCK_KERNEL_TYPES)
KERNEL_DIR = Path(__file__).parent
# compiled once per instruction set
ISA_SOURCES = ("quant_kernel_isa.cc", "block_kernel_isa.cc", "block_kernel_more_isa.cc")
KERNEL_SOURCES = ("quant_kernel.cc", *ISA_SOURCES, "quant_kernel.h", "quant_kernel_simd.h", "block_kernel_more.h",
                  "block_kernel_k4.h", "block_kernel_avx2int8.h")
# Instruction sets ISA_SOURCES are compiled for (x86-64), best first; other CPUs get "generic".
ISA_FLAGS = {"avx512vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512vbmi", "-mavx2",
                           "-mfma", "-mf16c"),
             "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
             "avx2int8": ("-mavx2", "-mfma", "-mf16c", "-DSKIPPY_INT8_AVX2"),
             "avx2": ("-mavx2", "-mfma", "-mf16c"),
             "generic": ()}
# the sets that run int8 activations (opt-in, by name: never auto)
INT8_ISAS = ("avx512vnni", "avx2int8")
# auto (default: the best float-activation loops) | avx512vnni, avx2int8 (int8 activations, opt-in) | avx512 | avx2
# | generic
ISA_ENV = "SKIPPY_KERNEL_ISA"
# here (default: only the loops this CPU runs, kernel_isas) | all (every instruction set: the tests switch between them)
BUILD_ENV = "SKIPPY_KERNEL_BUILD"
# the CPU flags (/proc/cpuinfo's names) each instruction set's loops need: quant_kernel.cc's has_* checks
CPU_FLAGS = {"avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx2", "fma", "f16c"},
             "avx512": {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"},
             "avx2int8": {"avx2", "fma", "f16c"},
             "avx2": {"avx2", "fma", "f16c"},
             "generic": set()}
# multiply-adds from which a kernel call shares its tasks with pool threads (set_min_parallel; default
# 4194304: a decode step's projections stay on their caller, the head and prefill chunks are shared;
# 65536 shares every decode projection too, as llama.cpp runs them: quant_kernel.cc says when it paid)
SHARE_ENV = "SKIPPY_KERNEL_SHARE_FROM"
# its value when unset, in a process that may use 2 CPUs or more (one CPU: the kernel's 4194304; no helper
# to share with anyway): every decode projection shared. SmolLM2 Q4_K_M, 1 stage, 2-core Xeon: the step
# 18.5 -> 11.4 ms quiet, median 44.9 -> 37.5 ms at load 9 (the backoff keeps a lost helper cheap), served
# 46.4 -> 53.2 tok/s quiet (docs/models.md, "Threads")
SHARE_DEFAULT = 65536
CACHE_ENV = "SKIPPY_KERNEL_CACHE"    # where built kernels go; default $XDG_CACHE_HOME/skippy_zmq
# where `skippy-zmq build-kernel` (make install) puts the kernel, looked in first; default <prefix>/share/skippy_zmq
INSTALL_ENV = "SKIPPY_KERNEL_INSTALL_DIR"
CXX_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-ffp-contract=fast", "-w")
CXX_TIMEOUT_S = 300
# one build and load at a time: a stage starts it in a thread (prepare_kernel) while it restores its
# weights, and a trace that needs the kernel meanwhile waits for that build instead of starting its own
_LOADING = threading.Lock()


def kernel_available() -> bool:
    """Whether the CPU kernel is built (once per machine and source) and registered."""
    return _load_kernel() is not None


def kernel_isa() -> str | None:
    """The instruction set the loaded kernel runs ("avx512vnni", "avx512", "avx2int8", "avx2", "generic"), or
    None."""
    kernel = _load_kernel()
    return kernel.isa if kernel is not None else None


@dataclasses.dataclass(frozen=True)
class _Kernel:
    lib: ctypes.CDLL   # kept referenced, so the library stays mapped for the life of the process
    isa: str


def prepare_kernel() -> threading.Thread:
    """Build (once per machine; seconds: five compiler runs) and load the kernel in a thread, so a
    starting stage restores its weights meanwhile; the first trace that needs it waits for it."""
    thread = threading.Thread(target=_load_kernel, name="kernel-build", daemon=True)
    thread.start()
    return thread


def _load_kernel() -> _Kernel | None:
    with _LOADING:
        return _load_kernel_once()


@functools.cache   # one build, load and warning per process
def _load_kernel_once() -> _Kernel | None:
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build_kernel()))
    except subprocess.CalledProcessError as exc:
        logger.warning("quantised-matmul CPU kernel failed to build, using the slow XLA fallback:\n{}",
                       (exc.stderr or "")[-2000:])
        return None
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        logger.warning("quantised-matmul CPU kernel unavailable, using the slow XLA fallback: {}", exc)
        return None
    kernel = _Kernel(lib, _select_isa(lib, os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"))
    share = os.environ.get(SHARE_ENV, "").strip() or (str(SHARE_DEFAULT) if len(os.sched_getaffinity(0)) >= 2 else "")
    if share:
        _set_min_parallel(lib, _share_from(share))
    for target in (*KERNEL_TARGETS.values(), *MOE_TARGETS.values(), ATTEND_TARGET, BLOCK_TARGET):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    logger.debug("quantised-matmul CPU kernel: {} loops", kernel.isa)
    return kernel


def _select_isa(lib: ctypes.CDLL, want: str) -> str:
    """Ask the library for `want` (SKIPPY_KERNEL_ISA); the best supported one if it cannot run here."""
    select = lib.skippy_kernel_select
    select.restype, select.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    got = select(want.encode())
    if got is None:
        got = select(b"auto")
        logger.warning("{}={} is unknown or not supported by this CPU (choices: auto, {}); using {}",
                       ISA_ENV, want, ", ".join(ISA_FLAGS), got.decode())
    return got.decode()


def set_min_parallel(work: int) -> int:
    """Set the multiply-adds from which one kernel call shares its tasks with XLA's pool threads
    (quant_kernel.cc's g_min_parallel; 0: every call of two tasks or more; at load $SKIPPY_KERNEL_SHARE_FROM,
    else SHARE_DEFAULT on 2 CPUs or more, else 4194304); returns the old value. Which thread runs a task
    changes no result."""
    kernel = _load_kernel()
    if kernel is None:
        raise RuntimeError("the quantised-matmul CPU kernel is not available")
    return _set_min_parallel(kernel.lib, work)


def _set_min_parallel(lib: ctypes.CDLL, work: int) -> int:
    setter = lib.skippy_kernel_set_min_parallel
    setter.restype, setter.argtypes = ctypes.c_int64, [ctypes.c_int64]
    return int(setter(work))


def _share_from(text: str) -> int:
    try:
        work = int(text)
    except ValueError:
        work = -1
    if work < 0:
        raise ValueError(f"{SHARE_ENV} must be a whole number of multiply-adds >= 0, got {text!r}")
    return work


def helper_stats() -> dict[str, int]:
    """Since the kernel loaded: calls shared with pool threads, tasks those helpers ran, and backoffs
    (a call kept waiting for a helper that lost its core; the next calls then ran alone)."""
    kernel = _load_kernel()
    if kernel is None:
        return {"shared_calls": 0, "helper_tasks": 0, "backoffs": 0}
    out = (ctypes.c_int64 * 3)()
    kernel.lib.skippy_kernel_helper_stats(out)
    return {"shared_calls": out[0], "helper_tasks": out[1], "backoffs": out[2]}


def supported_isas() -> list[str]:
    """The kernel's instruction sets this CPU can run, best first (auto picks the first with float
    activations; avx512vnni and avx2int8, int8 activations, only by name): empty without the kernel."""
    kernel = _load_kernel()
    if kernel is None:
        return []
    supports = kernel.lib.skippy_kernel_supports
    supports.restype, supports.argtypes = ctypes.c_int, [ctypes.c_char_p]
    return [isa for isa in kernel_isas() if supports(isa.encode())]


def kernel_isas() -> tuple[str, ...]:
    """The instruction sets the kernel library is built with on this machine, best first: on x86-64
    the one SKIPPY_KERNEL_ISA picks on this CPU (auto: the best with float activations) and generic,
    the fallback. A fresh machine's stage waits for this build: all four sets were 13 compiler runs,
    12-14 CPU s (8 s of a cold start on 2 cores). Every set with SKIPPY_KERNEL_BUILD=all, or where
    the CPU's flags cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("generic",)
    flags = _cpu_flags()
    if flags is None or os.environ.get(BUILD_ENV, "").strip().lower() == "all":
        return tuple(ISA_FLAGS)
    runs = [isa for isa in ISA_FLAGS if CPU_FLAGS[isa] <= flags]
    want = os.environ.get(ISA_ENV, "auto").strip().lower()
    auto = next(isa for isa in runs if isa not in INT8_ISAS)   # (generic always runs)
    return tuple(isa for isa in runs if isa in (want, auto, "generic"))


def _cpu_flags() -> set[str] | None:
    """This CPU's feature flags as Linux lists them (/proc/cpuinfo), or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def kernel_cache_dir() -> Path:
    """Built kernels live here, never in the source tree: $SKIPPY_KERNEL_CACHE,
    else $XDG_CACHE_HOME/skippy_zmq, else ~/.cache/skippy_zmq."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "skippy_zmq"


def installed_kernel_dir() -> Path:
    """Where `skippy-zmq build-kernel` builds the kernel at install time (make install), inside the
    installation like any package's native code: $SKIPPY_KERNEL_INSTALL_DIR, else <sys.prefix>/share/
    skippy_zmq/kernel (the venv's). A stage looks there first, so a new user's first start builds nothing."""
    return Path(os.environ.get(INSTALL_ENV) or Path(sys.prefix) / "share" / "skippy_zmq" / "kernel")


def install_kernel() -> Path:
    """Build the library of this CPU's sets (kernel_isas) into installed_kernel_dir, unless there
    already, and remove that folder's builds of the same sets from other sources or compilers."""
    built = _build_kernel(install=True)
    prefix = built.name.rsplit("-", 1)[0] + "-"
    for stale in built.parent.glob(f"{prefix}*.so"):
        if stale != built:
            stale.unlink(missing_ok=True)
    return built


def _build_kernel(install: bool = False) -> Path:
    """The kernel library: the installed one when it was built from these sources for this CPU's
    sets (a build for another CPU's, or stale, has another name and is passed over), else the cache's,
    else compiled now, into the cache (install=True: into installed_kernel_dir). Names are keyed by
    the sources, the ISAs, the compiler (path and version), flags and JAX's FFI headers."""
    isas = kernel_isas()
    if not install and (found := _installed_kernel(_build_ident(), isas)) is not None:
        return found
    path, ident = _compiler_ident()
    if not install and isas != tuple(ISA_FLAGS) and (every := _kernel_target(ident, tuple(ISA_FLAGS))).is_file():
        return every   # built with every set before (another SKIPPY_KERNEL_BUILD): it serves this CPU too
    target = _kernel_target(_build_ident(), isas, _install_dir()) if install else _kernel_target(ident, isas)
    if target.is_file():
        return target
    _compile_library(path, isas, target)
    return target


def _compiler_ident() -> tuple[str, list[str]]:
    """The compiler's path and what names a cached build of it: path, version and _build_ident."""
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    return path, [path, version.splitlines()[0] if version else "", *_build_ident()]


def _build_ident() -> list[str]:
    """What names an installed build: flags, JAX's FFI headers and version (with the sources and sets:
    _kernel_name). Not the compiler: a stage finds it without one (an image that dropped it after install)."""
    return [*CXX_FLAGS, jax.ffi.include_dir(), jax.__version__]


def _installed_kernel(ident: list[str], isas: tuple[str, ...]) -> Path | None:
    """The library build-kernel left for these sets (or for every set), when its folder and file are
    ours or root's and writable by no one else (private_dirs' rule; root: a system-wide install)."""
    folder = installed_kernel_dir()
    for want in (isas, tuple(ISA_FLAGS)):
        target = folder / _kernel_name(ident, want)
        if not os.path.lexists(target):
            continue
        reason = unsafe_reason(folder, owners=(os.getuid(), 0)) or unsafe_reason(target, follow=False,
                                                                                   owners=(os.getuid(), 0))
        if reason is None:
            return target
        logger.warning("installed kernel {} {}: not loading it", target, reason)
    return None


def _install_dir() -> Path:
    folder = private_cache_dir(installed_kernel_dir(), "installed kernel folder", mode=0o755)
    if folder is None:
        raise RuntimeError(f"cannot build the kernel into {installed_kernel_dir()} (the log says why)")
    return folder


def _compile_library(path: str, isas: tuple[str, ...], target: Path) -> None:
    """Compile the library of these instruction sets into `target`, built aside and published atomically."""
    include = jax.ffi.include_dir()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        units = {f"{tmp}/{Path(source).stem}_{isa}.o": (*ISA_FLAGS[isa], f"-DSKIPPY_ISA={isa}", str(KERNEL_DIR / source))
                 for isa in isas for source in ISA_SOURCES}
        left_out = tuple(f"-DSKIPPY_NO_{isa}" for isa in ISA_FLAGS if isa not in isas and isa != "generic")
        units[f"{tmp}/glue.o"] = (*left_out, "-I", include, str(KERNEL_DIR / "quant_kernel.cc"))
        _compile_all(path, units)
        out = Path(tmp) / target.name
        subprocess.run([path, *CXX_FLAGS, "-shared", *units, "-o", str(out)], check=True, capture_output=True,
                       text=True, timeout=CXX_TIMEOUT_S)
        os.chmod(out, 0o755)      # whatever the umask: a group-writable .so would be refused next time
        os.replace(out, target)


def _kernel_target(ident: list[str], isas: tuple[str, ...], folder: Path | None = None) -> Path:
    """Where the library of these instruction sets goes: in `folder`, else in the cache (_kernel_path)."""
    name = _kernel_name(ident, isas)
    return folder / name if folder is not None else _kernel_path(name)


def _kernel_name(ident: list[str], isas: tuple[str, ...]) -> str:
    """The library's file name: a key of the sources, the compiler's `ident` (path, version, flags,
    JAX's FFI headers) and the sets with their flags; the sets are named in it too."""
    ident = [*ident, *(f"{isa}:{' '.join(ISA_FLAGS[isa])}" for isa in isas)]
    key = hashlib.sha256(b"".join((KERNEL_DIR / f).read_bytes() for f in KERNEL_SOURCES)
                         + "\n".join(ident).encode()).hexdigest()[:16]
    return f"quant_kernel-{platform.machine()}-{'+'.join(isas)}-{key}.so"


def _compile_all(cxx: str, units: dict[str, tuple[str, ...]]) -> None:
    """Compile every object ({output: flags and source}) at once, one compiler process each: on a
    cold machine the five of them one after another were 5 s of a stage's start (2 cores)."""
    procs = {obj: subprocess.Popen([cxx, *CXX_FLAGS, *args[:-1], "-c", args[-1], "-o", obj], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for obj, args in units.items()}
    failed = None
    try:
        for proc in procs.values():
            _out, err = proc.communicate(timeout=CXX_TIMEOUT_S)
            if proc.returncode and failed is None:
                failed = subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
    finally:
        for proc in procs.values():   # a timeout leaves the others running: end them
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed is not None:
        raise failed


def _kernel_path(name: str) -> Path:
    """Where the built kernel is or goes: the cache when the folder and the file are ours and writable
    only by us (private_dirs), else a fresh 0700 folder of this process's own (built again, logged)."""
    cache = private_cache_dir(kernel_cache_dir(), "kernel cache")
    if cache is not None:
        target = cache / name
        if not os.path.lexists(target) or (reason := unsafe_reason(target, follow=False)) is None:
            return target
        logger.warning("kernel {} {}: building a private copy instead", target, reason)
    return _private_kernel_dir() / name


@functools.cache
def _private_kernel_dir() -> Path:
    """This process's own 0700 folder for a kernel the cache cannot safely hold: made on first need
    (one for every lookup), removed when the process exits (not by a forked child's exit)."""
    folder = Path(tempfile.mkdtemp(prefix="skippy-kernel-"))
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
    return folder
