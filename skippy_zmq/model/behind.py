"""Compile a slice's whole-slice steps in a child process, into the persistent compilation cache,
while the stage serves (SliceRunner.compile_behind).

Why a process: XLA:CPU compiles on its client's pool threads, so a compile thread of the stage
itself competed with a first request's layer-by-layer steps for the cores whatever its own
priority (a first chat request after READY took 3.5x a warm one, SmolLM2 on 2 cores). The child
runs at normal priority and is gated by the stage's `quiet` instead (Child.gate): SIGSTOP while a
request holds a lane, which freezes every XLA thread of it at once (what no in-process compile
allows), SIGCONT once quiet again, or once it has been stopped for the stage's behind_yield_s in a
row (steady traffic still gets its shapes: it then runs until its next shape). SCHED_IDLE and
nice 19 were tried first: on a saturated host (the test suite on 2 cores, a CI machine with hogs
beside it) they starved the child for minutes, while the point is only to keep the compile off
the cores while a request runs.

It needs no weights: it lowers the same jitted step from abstract shapes (the params pytree with
its QTensor/BlockTensor leaves, the KV, the inputs) and compiles it, which writes the cache entry;
the stage then reads each shape from the cache (the same HLO, options and device: a read of
milliseconds, no XLA compile) while it is quiet.

The child dies with the stage: it reads its stdin to EOF (the stage's end closes it), asks the
kernel for SIGKILL when its parent thread goes (PR_SET_PDEATHSIG), and the stage continues and
kills it once it has been silent for CHILD_SHAPE_S of the time it was let run. Any failure only
means the stage compiles the rest in its own thread, as before.

    python -m skippy_zmq.model.behind PARENT_PID   # a pickled BehindJob on stdin (8-byte size first); never run by hand
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

from loguru import logger

CHILD_COMMAND = (sys.executable, "-m", "skippy_zmq.model.behind")
CHILD_SHAPE_S = 180.0   # a child that reports no shape in this long of running is given up: killed, the rest in-thread
# how often the stage gates the child and serves its own wanted shapes between the child's reports: also
# how long a request that just took a lane may share the cores with the child's compile (was 0.2 s)
TICK_S = 0.05
PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class Leaf:
    """An array's shape and dtype: what lowering reads of it (the child never sees a weight)."""
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class BehindJob:
    """What the child compiles: forward_jit for each (inputs shape, attention length, output)."""
    cfg: Any             # ModelConfig
    start: int
    end: int
    params: Any          # the slice's params pytree, every array a Leaf
    kv: Any              # the KVCache, every array a Leaf
    capacity: int
    shapes: tuple[tuple, ...]
    cache_dir: str


def abstract(tree: Any) -> Any:
    """`tree` with each array replaced by its Leaf (containers and static fields kept)."""
    import jax

    return jax.tree.map(lambda a: Leaf(tuple(a.shape), str(a.dtype)), tree)


def _code_digest() -> str:
    """A digest of the model package's sources and JAX's versions: a mark made by other code means nothing."""
    import hashlib
    from pathlib import Path

    import jax
    import jaxlib

    digest = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__}".encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


_CODE_DIGEST: list[str] = []


def mark_path(job: BehindJob, shape: tuple) -> str:
    """Where the stage marks, in the persistent cache's folder, that `shape` of this job is in the cache."""
    import hashlib

    if not _CODE_DIGEST:
        _CODE_DIGEST.append(_code_digest())
    key = pickle.dumps((_CODE_DIGEST[0], job.cfg, job.start, job.end, job.params, job.kv, job.capacity, shape))
    return os.path.join(job.cache_dir, "skippy-behind-marks", hashlib.sha256(key).hexdigest()[:32])


def mark(job: BehindJob | None, shape: tuple) -> None:
    """Say that the stage has compiled (so the cache holds) `shape` of `job` (None, or not one of its
    shapes: nothing): a later start of the same slice on the same code finds every shape marked and
    starts no child (`all_marked`)."""
    if job is None or shape not in job.shapes:
        return
    path = mark_path(job, shape)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:   # a hint only: without it the next start runs the child, as before
        logger.debug("compile-behind mark not written: {}", exc)


def all_marked(job: BehindJob) -> bool:
    """Whether every shape of the job was compiled by an earlier start of this slice on this code.
    Then the child would only trace and lower each shape to find it in the cache, which the stage
    does again to read it: its whole run (a Python with JAX, every shape lowered) is saved. A mark is
    a hint: a shape missing from the cache all the same is compiled in the stage's thread."""
    return all(os.path.exists(mark_path(job, shape)) for shape in job.shapes)


def start(job: BehindJob, command: tuple[str, ...] = CHILD_COMMAND, shape_s: float = CHILD_SHAPE_S) -> Child | None:
    """The child started on `job`; None (logged) when it cannot start or every shape is marked."""
    if all_marked(job):
        logger.debug("every compile-behind shape is marked in the cache: read in the stage, no child")
        return None
    try:
        return Child(job, command, shape_s)
    except OSError as exc:
        logger.warning("compile-behind child cannot start: {}", exc)
        return None


class Child:
    """The compile child, started on a job: its reports (`reports`) and its gate (`gate`).
    A context manager: on leaving, the child is continued, killed and reaped, however it went."""

    def __init__(self, job: BehindJob, command: tuple[str, ...] = CHILD_COMMAND, shape_s: float = CHILD_SHAPE_S):
        self.proc = subprocess.Popen([*command, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.shape_s = shape_s
        self.stopped_at: float | None = None   # monotonic time of its SIGSTOP; None: it runs
        self.forced = False   # continued while busy (stopped yield_s): it runs until its next shape
        self.done = self.forced_at = 0   # shapes it reported; how many when it was forced on
        self.total = len(job.shapes)
        # said once its death signal is armed and its stdin watched: a child stopped before that
        # outlived a stage that died (found stopped, an orphan, after a test run)
        self.ready = False
        self._gate_lock, self._closed = threading.Lock(), False   # gate() / pause() from two threads
        try:
            data = pickle.dumps(job)
            self.proc.stdin.write(len(data).to_bytes(8, "little") + data)   # sized: read before unpickled
            self.proc.stdin.flush()   # stdin stays open: its EOF tells the child that we are gone
        except OSError as exc:   # gone already: reports() sees its exit
            logger.warning("compile-behind child {} took no job: {}", self.proc.pid, exc)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *_: object) -> None:
        with self._gate_lock:   # no pause() after this
            self._closed = True
        self._signal(signal.SIGCONT)   # a stopped child would take its SIGKILL only once continued
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:   # a broken stdin (the child gone first) is nothing to report
                pass

    def _signal(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:   # exited (not yet reaped: send_signal skips a reaped one)
            pass

    def _runs_anyway(self) -> bool:
        """Left running while the stage is busy: forced on (until its next shape), not yet `ready`
        to be stopped, or done with every shape (it is only exiting)."""
        return self.forced or not self.ready or self.done >= self.total

    def _stop(self) -> None:
        self._signal(signal.SIGSTOP)
        self.stopped_at = time.monotonic()

    def pause(self) -> None:
        """Stop it now: the stage just got busy (the stage loop's thread calls this), where gate()
        stops it only at the compile thread's next tick, up to TICK_S later: both stages' children
        compiling on into a first request took 0.12-0.18 of its 1.2 CPU s (measured, issue 39).
        A forced or finished child is left to gate(), as it would leave it."""
        with self._gate_lock:
            if not (self._closed or self.stopped_at is not None or self._runs_anyway()):
                self._stop()

    def gate(self, quiet: bool, yield_s: float) -> bool:
        """Stop the child while the stage is busy (not `quiet`), continue it once quiet, or once
        stopped for `yield_s` in a row (then it runs until its next shape, `forced`): True then."""
        with self._gate_lock:
            return self._gate(quiet, yield_s)

    def _gate(self, quiet: bool, yield_s: float) -> bool:
        self.forced = self.forced and self.done == self.forced_at
        if quiet or self._runs_anyway():
            if self.stopped_at is not None:
                self._signal(signal.SIGCONT)
                self.stopped_at = None
            return False
        if self.stopped_at is None:
            self._stop()
            return False
        if time.monotonic() - self.stopped_at < yield_s:
            return False
        self._signal(signal.SIGCONT)
        self.stopped_at, self.forced, self.forced_at = None, True, self.done
        return True

    def reports(self, tick_s: float = TICK_S) -> Iterator[int | None]:
        """The index of each shape the child compiled into the cache, in its order, and None every
        `tick_s` between them (the caller gates it and serves its own work); ends when the child is
        done, fails, exits or stays silent for `shape_s` of the time it was let run (logged: the
        caller compiles what is left)."""
        try:
            for line in self._lines(tick_s):
                if line is None or line.startswith(b"done "):
                    yield line if line is None else int(line.split()[1])
                elif line.startswith(b"failed "):
                    logger.warning("compile-behind child failed: {}", line[7:].decode(errors="replace").strip())
        except (OSError, ValueError) as exc:
            logger.warning("compile-behind child unusable: {}", exc)

    def _lines(self, tick_s: float) -> Iterator[bytes | None]:
        """The child's stdout lines, None for each `tick_s` without one."""
        fd, buffer, silent = self.proc.stdout.fileno(), b"", 0.0
        while silent < self.shape_s:
            running, t0 = self.stopped_at is None, time.monotonic()   # gate() runs only between yields
            ready, _, _ = select.select([fd], [], [], tick_s)
            silent += (time.monotonic() - t0) if running else 0.0
            if not ready:
                yield None
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                code = self.proc.wait()
                if code:
                    logger.warning("compile-behind child {} exited with code {}", self.proc.pid, code)
                return
            buffer, silent = buffer + chunk, 0.0
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                self.done += line.startswith(b"done ")
                self.ready = self.ready or line == b"ready"
                yield line
        logger.warning("compile-behind child {} silent for {:g} s while let run: given up", self.proc.pid, self.shape_s)


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent (its thread that started us) goes, and exit now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (AttributeError, OSError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _exit_on_eof() -> None:
    while os.read(0, 4096):
        pass
    os._exit(0)


def compile_job(job: BehindJob, report: Any) -> None:
    """Lower and compile forward_jit for each shape of `job` (the cache keeps it); report(i) after each."""
    import jax
    import numpy as np

    from skippy_zmq.model import exec_cache
    from skippy_zmq.model.kernel import kernel_available
    from skippy_zmq.model.llama import forward_jit

    kernel_available()   # registers the FFI targets the step calls (built already: the stage did it)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    aval = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    concrete = lambda tree: jax.tree.map(lambda a: aval(a.shape, a.dtype), tree,  # noqa: E731
                                         is_leaf=lambda a: isinstance(a, Leaf))
    params, kv = concrete(job.params), concrete(job.kv)
    stored = exec_cache.ExecCache.for_runner(jax.devices("cpu")[0], job.cfg, params)
    for i, (shape, attn_len, output) in enumerate(job.shapes):
        inputs = aval(shape, np.int32 if job.start == 0 else np.float32)
        positions, lanes = aval(shape[:2], np.int32), aval(shape[:1], np.int32)
        static = dict(cfg=job.cfg, start=job.start, end=job.end, attn_len=attn_len, output=output)
        compiled, fresh = exec_cache.compile_fresh(forward_jit.lower(params, kv, inputs, positions, lanes, **static))
        if stored is not None and fresh:   # the stage's thread loads it, neither tracing nor lowering
            stored.store(stored.path(kv, (inputs, positions, lanes), static), compiled)
        report(i)


def _read_job_bytes() -> bytes:
    """The pickled job's bytes (sized by an 8-byte prefix), read without unpickling it."""
    size, data = None, b""
    while size is None or len(data) < size:
        chunk = os.read(0, (8 if size is None else size) - len(data))
        if not chunk:
            os._exit(0)   # the stage went before it sent the job
        data += chunk
        if size is None and len(data) == 8:
            size, data = int.from_bytes(data, "little"), b""
    return data


def child_main(parent: int) -> int:
    die_with_parent(parent)
    data = _read_job_bytes()
    threading.Thread(target=_exit_on_eof, name="parent-eof", daemon=True).start()
    sys.stdout.buffer.write(b"ready\n")   # only now may the stage stop us (Child.gate)
    sys.stdout.buffer.flush()
    # Unpickled after `ready`: it imports JAX and the model (~1.4 CPU s), which the stage could not
    # stop before, so it ran beside a first request that came right after READY.
    job = pickle.loads(data)
    import jax

    jax.config.update("jax_compilation_cache_dir", job.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)   # every entry written
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    out = sys.stdout.buffer

    def report(i: int) -> None:
        out.write(b"done %d\n" % i)
        out.flush()

    t0 = time.perf_counter()
    try:
        compile_job(job, report)
    except Exception as exc:   # the stage compiles the rest itself
        out.write(f"failed {type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n")
        out.flush()
        return 2
    logger.debug("compile-behind child: {} shapes in {:.1f}s", len(job.shapes), time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))
