"""The llama.cpp a user deploys, built here: `llama-server`, `llama-bench` and `rpc-server` from the
llama.cpp that the llama-cpp-python sdist on PyPI vendors (`vendor/llama.cpp`), CPU only.

    skippy-zmq bench peers --build        (or `make peers`)

Built once into a cache outside the repository (`$SKIPPY_PEERS_DIR`, default
`~/.cache/skippy_zmq/llama.cpp-<version>`), with `cmake` and `ninja` from PyPI (the `peers-build`
extra); about 10-15 minutes on 2 cores. `build.json` there records what was built, how and how
long it took; a later call finds it and reuses the binaries.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

SDIST_VERSION = "0.3.36"
# tool name -> the binary CMake writes (the RPC server's target is ggml-rpc-server)
BINARIES = {"llama-server": "llama-server", "llama-bench": "llama-bench", "rpc-server": "ggml-rpc-server"}
# CPU only, no network at build or run time (no HTTPS client, no prebuilt web UI fetched from the Hub)
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release", "GGML_NATIVE": "ON", "GGML_RPC": "ON", "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_OPENSSL": "OFF", "GGML_OPENMP": "ON",
}


def cache_dir() -> Path:
    env = os.environ.get("SKIPPY_PEERS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "skippy_zmq" / f"llama.cpp-{SDIST_VERSION}"


def binary_paths(root: Path) -> dict[str, Path]:
    return {tool: root / "build" / "bin" / name for tool, name in BINARIES.items()}


def built(root: Path | None = None) -> dict[str, Any] | None:
    """The record of a finished build whose binaries are all there, else None."""
    root = root or cache_dir()
    try:
        record = json.loads((root / "build.json").read_text())
    except (OSError, ValueError):
        return None
    paths = binary_paths(root)
    if record.get("version") != SDIST_VERSION or not all(p.is_file() for p in paths.values()):
        return None
    return {**record, "binaries": {tool: str(p) for tool, p in paths.items()}}


def configure_command(cmake: str, ninja: str, source: Path, build: Path) -> list[str]:
    return [cmake, "-S", str(source), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
            *(f"-D{k}={v}" for k, v in CMAKE_OPTIONS.items())]


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
    raises CalledProcessError where pip cannot get it (no network)."""
    download = (root or cache_dir()) / "sdist"
    archive = download / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not archive.is_file():
        download.mkdir(parents=True, exist_ok=True)
        print(f"[peers] downloading the llama-cpp-python {SDIST_VERSION} sdist", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={SDIST_VERSION}", "-d", str(download)], check=True)
    return archive


def _source(root: Path) -> Path:
    """vendor/llama.cpp of the sdist, downloaded (pip, from PyPI) and unpacked under root once."""
    source = root / "src" / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    archive = sdist(root)
    with tarfile.open(archive) as tar:
        tar.extractall(root / "src", filter="data")
    if not (source / "CMakeLists.txt").is_file():
        raise SystemExit(f"{archive} has no vendor/llama.cpp")
    return source


def build(root: Path | None = None, jobs: int | None = None, force: bool = False) -> dict[str, Any]:
    """Build the peers (or find the finished build) and return build.json's record with binary paths."""
    root = root or cache_dir()
    if not force and (record := built(root)):
        print(f"[peers] reusing the build in {root} ({record['seconds']:.0f} s on {record['built']})", flush=True)
        return record
    jobs = jobs or os.cpu_count() or 2
    cmake, ninja = _tool("cmake"), _tool("ninja")
    source = _source(root)
    out = root / "build"
    if force:
        shutil.rmtree(out, ignore_errors=True)
    print(f"[peers] building {', '.join(BINARIES)} from {source} with {jobs} jobs "
          f"(about 10-15 minutes on 2 cores); log: {root / 'build.log'}", flush=True)
    t0 = time.monotonic()
    with open(root / "build.log", "w") as log:
        for cmd in (configure_command(cmake, ninja, source, out), build_command(cmake, out, jobs)):
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"llama.cpp build failed; see {root / 'build.log'}")
    seconds = time.monotonic() - t0
    cmake_version = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    record = {"version": SDIST_VERSION, "seconds": round(seconds, 1), "jobs": jobs,
              "built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
              "cmake": cmake_version, "options": CMAKE_OPTIONS}
    (root / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[peers] built in {seconds / 60:.1f} min into {out / 'bin'}", flush=True)
    return built(root) or record
