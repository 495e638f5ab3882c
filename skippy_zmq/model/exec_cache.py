"""Serialised whole-slice executables beside JAX's compile cache, so a restarted stage's steps skip
trace and lowering (issue 39: a stage start's CPU).

With XLA's persistent cache warm, jit still traces and lowers every shape to compute the cache key
before it reads the executable: a SmolLM2 half's 64 whole-slice shapes spent 6.3 of its 22.6 CPU s
after READY tracing and lowering, 7.9 reading (docs/development.md, "Where the CPU goes"). Here
each shape's compiled forward_jit is stored once (jax.experimental.serialize_executable), under a
key of everything that changes the executable, and a later start loads it (reading costs what
XLA's cache read costs) straight into the runner's DirectStep table (direct.Steps.adopt): no trace,
no lowering, no cache-key hashing.

Only an executable XLA compiled in this process is stored (`compile_fresh`): jaxlib 0.10.2's CPU
executables read from the persistent cache serialise short (156 against 228 kB for a tiny step) and
fail when run ("NOT_FOUND: Function bitcast_multiply_fusion not found"), so a warm XLA cache writes
nothing here; the compile-behind child (model/behind.py), which compiles a cold start's shapes,
stores them, and the stage's thread loads them. Only on the CPU (DirectStep's platform), only where
JAX's compile cache has a folder (the files are code: they sit in that private folder). A file that does not load (truncated, corrupt, another
JAX) logs one line and the shape compiles as before, which rewrites it; writes are atomic.
SKIPPY_EXEC_CACHE=off turns the cache off (A/B measurements).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
from loguru import logger

from skippy_zmq.files.private_dirs import private_cache_dir
from skippy_zmq.model import direct

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # a compile or a persistent-cache read
HIT_EVENT = "/jax/compilation_cache/cache_hits"
FORMAT = 1            # this file's layout and key recipe: bump to orphan every stored file
FOLDER = "skippy-executables"
# the package files whose code builds a whole-slice step (or the native kernel it calls)
CODE_GLOBS = ("model/*.py", "model/*.cc", "model/*.h", "config/model.py")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of the files that build the step: a code change leaves every stored file unused."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(p for g in CODE_GLOBS for p in root.glob(g)):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


class _Seen(threading.local):
    compiles = hits = 0


_SEEN = _Seen()


def _on_duration(name: str, _secs: float, **_: object) -> None:
    if name == COMPILE_EVENT:
        _SEEN.compiles += 1


def _on_event(name: str, **_: object) -> None:
    if name == HIT_EVENT:
        _SEEN.hits += 1


@functools.lru_cache(maxsize=1)
def _listen() -> None:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def compile_fresh(lowered: Any) -> tuple[Any, bool]:
    """lowered.compile(), and whether XLA compiled it here and now (not jit's memory, not a
    persistent-cache read): only such an executable serialises whole (module docstring)."""
    _listen()
    compiles, hits = _SEEN.compiles, _SEEN.hits
    compiled = lowered.compile()
    return compiled, _SEEN.compiles > compiles and _SEEN.hits == hits


def _avals(tree: Any) -> str:
    """A tree's structure and its leaves' shapes and dtypes (what an executable's inputs must match)."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr(treedef) + repr([(tuple(x.shape), str(x.dtype)) for x in leaves])


def folder() -> Path | None:
    """The cache's folder inside JAX's compile cache folder, or None (no compile cache, or turned off)."""
    base = jax.config.jax_compilation_cache_dir
    if not base or os.environ.get("SKIPPY_EXEC_CACHE", "").strip().lower() in ("off", "0", "false", "no"):
        return None
    return private_cache_dir(Path(base) / FOLDER, "executable cache")


class ExecCache:
    """Stored executables of one runner's forward_jit: its model, layers, weights tree and device."""

    def __init__(self, where: Path, device: Any, cfg: Any, params: Any):
        from skippy_zmq.model import quant   # the kernel's instruction set: its loops are in the executable

        self.where, self.device = where, device
        self._base = repr((FORMAT, code_digest(), jax.__version__, jax.lib.__version__, device.platform,
                           device.device_kind, quant.kernel_isa(), os.environ.get("XLA_FLAGS", ""),
                           repr(cfg), _avals(params)))

    @classmethod
    def for_runner(cls, device: Any, cfg: Any, params: Any) -> ExecCache | None:
        """The cache of a runner on `device`, or None where there is none (not a CPU, no folder)."""
        if device.platform != "cpu":
            return None
        where = folder()
        return cls(where, device, cfg, params) if where is not None else None

    def path(self, kv: Any, inputs: tuple[jax.Array, ...], static: dict[str, Any]) -> Path:
        """The file of one step: the runner's key plus the KV's and inputs' avals and the static arguments."""
        key = repr((self._base, _avals(kv), _avals(inputs), sorted((k, repr(v)) for k, v in static.items())))
        return self.where / (hashlib.sha256(key.encode()).hexdigest() + ".exe")

    def load(self, path: Path, params: Any, kv: Any, inputs: tuple[jax.Array, ...]) -> direct.DirectStep | None:
        """The stored step at `path` as a DirectStep for these arguments, or None (missing, or it did not
        load: one line logged, the caller compiles)."""
        from jax.experimental import serialize_executable

        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            fmt, serialized, out_tree = pickle.loads(blob)
            if fmt != FORMAT:
                raise ValueError(f"format {fmt}, not {FORMAT}")
            in_tree = jax.tree.structure(((params, kv, *inputs), {}))
            compiled = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                                 execution_devices=[self.device])
            step = direct.from_compiled(compiled, params, kv, inputs)
            if step is None:
                raise ValueError("not a step DirectStep can call")
        except Exception as exc:   # a corrupt pickle raises anything; every failure falls back the same way
            logger.warning("executable cache: {} did not load ({}: {}); compiling", path.name,
                           type(exc).__name__, exc)
            return None
        return step

    def store(self, path: Path, compiled: Any) -> None:
        """Write `compiled` (forward_jit's, for the arguments `path` was made from) atomically; a
        failure (disk full, an executable that does not serialise) logs one line and stores nothing."""
        from jax.experimental import serialize_executable

        try:
            serialized, _in_tree, out_tree = serialize_executable.serialize(compiled)
            blob = pickle.dumps((FORMAT, serialized, out_tree))
            fd, tmp = tempfile.mkstemp(dir=self.where, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as exc:   # the cache is an optimisation: a stage runs on without it
            logger.warning("executable cache: {} not stored ({}: {})", path.name, type(exc).__name__, exc)
