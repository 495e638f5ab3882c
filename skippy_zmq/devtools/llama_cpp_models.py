"""llama.cpp's `models/` folder for tests and fixture scripts: its vocabularies (ggml-vocab-*.gguf
with .inp/.out test vectors) and real chat templates, from the llama-cpp-python sdist on the
package registry, extracted once into a cache outside the repository. Nothing at run time needs
it; every tar member is checked before it is written (staged_path)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from loguru import logger

from skippy_zmq.devtools.bench import llama_build
from skippy_zmq.files.fetch import FetchError

_CHUNK_BYTES = 1 << 20

LLAMA_CPP_SDIST = ("llama-cpp-python", llama_build.SDIST_VERSION)
_VENDOR_MODELS = "vendor/llama.cpp/models/"


def default_cache() -> Path:
    """Where fetched test material lives, outside the repository: $SKIPPY_CACHE or ~/.cache/skippy-zmq."""
    return Path(os.environ.get("SKIPPY_CACHE") or Path.home() / ".cache" / "skippy-zmq")


def fetch_llama_cpp_models(cache: Path | None = None) -> Path:
    """llama.cpp's `models/` folder (ggml-vocab-*.gguf with .inp/.out test vectors, templates/*.jinja)
    from the llama-cpp-python sdist on the package registry, extracted once into the cache.

    Returns the folder; raises FetchError when the registry cannot be reached."""
    package, version = LLAMA_CPP_SDIST
    target = (cache or default_cache()) / f"llama.cpp-models-{version}"
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # one fetch at a time per cache (the suite's parallel workers ask at once): a second waits for the
    # first and finds the folder complete, rather than replacing it while the first one's readers read
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").is_file():
            return target
        return _extract_llama_cpp_models(target, package, version)


def _extract_llama_cpp_models(target: Path, package: str, version: str) -> Path:
    # the sdist the peers build and llama.cpp's server tests read too (one download, cached)
    logger.info("reading llama.cpp's vocabularies and templates from the {}=={} sdist", package, version)
    try:
        archive = llama_build.sdist()
    except (subprocess.CalledProcessError, OSError) as exc:
        raise FetchError(f"could not download the {package}=={version} sdist: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="skippy-sdist-", dir=target.parent) as tmp:
        staged = Path(tmp) / "models"
        with tarfile.open(archive) as sdist:
            extract_under(sdist, _VENDOR_MODELS, staged)
        (staged / ".complete").write_text(f"{package}=={version}\n")
        if target.exists():
            import shutil
            shutil.rmtree(target)
        os.replace(staged, target)
    return target


def extract_under(archive: tarfile.TarFile, prefix: str, staged: Path) -> int:
    """Copy the plain files under `prefix` (after the sdist's top folder) into `staged`; returns how
    many. Members that would land outside `staged` are skipped (staged_path)."""
    count = 0
    for member in archive:
        name = member.name.split("/", 1)[-1]
        if not name.startswith(prefix):
            continue
        rel = staged_path(member, name[len(prefix):], staged)
        if rel is None:
            continue
        (staged / rel).parent.mkdir(parents=True, exist_ok=True)
        with archive.extractfile(member) as src, open(staged / rel, "wb") as out:
            while chunk := src.read(_CHUNK_BYTES):
                out.write(chunk)
        count += 1
    return count


def staged_path(member: tarfile.TarInfo, rel: str, staged: Path) -> Path | None:
    """Where a tar member goes under `staged`, or None (skipped, with a warning) for anything but a
    plain file whose relative path stays inside: absolute paths (`models//etc/x` is `/etc/x` once
    joined), `..`, empty parts, links and devices are refused. tarfile's data filter checks the
    member too (its checks, not ours alone), though we copy the bytes ourselves."""
    parts = rel.split("/")
    if not member.isfile() or not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        logger.warning("skipping tar member {!r}: not a plain file with a plain relative path", member.name)
        return None
    try:
        tarfile.data_filter(member.replace(name=rel, deep=False), str(staged))
    except tarfile.FilterError as exc:
        logger.warning("skipping tar member {!r}: {}", member.name, exc)
        return None
    target = (staged / rel).resolve()
    if not target.is_relative_to(staged.resolve()):
        logger.warning("skipping tar member {!r}: it would land outside {}", member.name, staged)
        return None
    return Path(*parts)
