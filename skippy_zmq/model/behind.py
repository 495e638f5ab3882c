"""Compile a slice's whole-slice steps in a low-priority child process, into the persistent
compilation cache, while the stage serves (SliceRunner.compile_behind).

Why a process: XLA:CPU compiles on its client's pool threads, so a compile thread of the stage
itself competed with a first request's layer-by-layer steps for the cores whatever its own
priority (a first chat request after READY took 3.5x a warm one, SmolLM2 on 2 cores). A child
made SCHED_IDLE and nice 19 before JAX starts runs every one of its threads at that priority:
it takes only what the stage leaves idle. It needs no weights: it lowers the same jitted step
from abstract shapes (the params pytree with its QTensor/BlockTensor leaves, the KV, the inputs)
and compiles it, which writes the cache entry; the stage then reads each shape from the cache
(the same HLO, options and device: a read of milliseconds, no XLA compile) while it is quiet.

The child dies with the stage: it reads its stdin to EOF (the stage's end closes it), asks the
kernel for SIGKILL when its parent thread goes (PR_SET_PDEATHSIG), and the stage kills it past
a deadline. Any failure only means the stage compiles the rest in its own thread, as before.

    python -m skippy_zmq.model.behind PARENT_PID   # a pickled BehindJob on stdin; never run by hand
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
CHILD_SHAPE_S = 180.0   # a child that reports no shape for this long is given up: killed, the rest in-thread
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


def run_child(job: BehindJob, command: tuple[str, ...] = CHILD_COMMAND,
              shape_s: float = CHILD_SHAPE_S) -> Iterator[int]:
    """Start the child on `job` and yield the index of each shape it has compiled into the cache, in
    order; ends when it is done, fails, exits or stays silent past `shape_s` (logged: the caller
    compiles what is left). The child is killed and reaped when this ends, however it ends."""
    proc = subprocess.Popen([*command, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        proc.stdin.write(pickle.dumps(job))
        proc.stdin.flush()   # stdin stays open: its EOF tells the child that we are gone
        for line in _lines(proc, shape_s):
            if line.startswith(b"done "):
                yield int(line.split()[1])
            elif line.startswith(b"failed "):
                logger.warning("compile-behind child failed: {}", line[7:].decode(errors="replace").strip())
    except (OSError, ValueError) as exc:
        logger.warning("compile-behind child unusable: {}", exc)
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:   # a broken stdin (the child gone first) is nothing to report
                pass


def _lines(proc: subprocess.Popen, shape_s: float) -> Iterator[bytes]:
    """The child's stdout lines, each within `shape_s` of the last (else logged, and the end)."""
    fd, buffer = proc.stdout.fileno(), b""
    while True:
        ready, _, _ = select.select([fd], [], [], shape_s)
        if not ready:
            logger.warning("compile-behind child {} silent for {:g} s: given up", proc.pid, shape_s)
            return
        chunk = os.read(fd, 4096)
        if not chunk:
            code = proc.wait()
            if code:
                logger.warning("compile-behind child {} exited with code {}", proc.pid, code)
            return
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from lines


def lower_priority() -> None:
    """SCHED_IDLE and nice 19 for this thread and every thread it starts (JAX's, XLA's pools)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):   # not Linux: nice alone
        pass
    os.nice(19)


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

    from skippy_zmq.model.kernel import kernel_available
    from skippy_zmq.model.llama import forward_jit

    kernel_available()   # registers the FFI targets the step calls (built already: the stage did it)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    aval = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    concrete = lambda tree: jax.tree.map(lambda a: aval(a.shape, a.dtype), tree,  # noqa: E731
                                         is_leaf=lambda a: isinstance(a, Leaf))
    params, kv = concrete(job.params), concrete(job.kv)
    for i, (shape, attn_len, output) in enumerate(job.shapes):
        inputs = aval(shape, np.int32 if job.start == 0 else np.float32)
        positions, lanes = aval(shape[:2], np.int32), aval(shape[:1], np.int32)
        forward_jit.lower(params, kv, inputs, positions, lanes, cfg=job.cfg, start=job.start, end=job.end,
                          attn_len=attn_len, output=output).compile()
        report(i)


def child_main(parent: int) -> int:
    lower_priority()
    die_with_parent(parent)
    job = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_on_eof, name="parent-eof", daemon=True).start()
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
