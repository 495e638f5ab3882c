"""A process spawned by a local parent dies with it, by any signal, SIGKILL included.

The spawner puts its pid in the child's environment (`tied_env`); the child calls
`watch_parent()` as it starts: if its parent is already gone (it died between fork and
here) it exits at once, else a daemon thread blocks on a pidfd of the parent (no polling,
no CPU while it waits) and sends this process SIGTERM when the parent exits. That also
holds when the spawning thread exits before the process does, where PR_SET_PDEATHSIG
would fire early. Processes started detached (`skippy-zmq launch`, `scripts/launch.sh`,
`restart-stage`, stages on remote hosts) carry no pid and keep their documented lifetime.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

from loguru import logger

PARENT_ENV = "SKIPPY_PARENT_PID"
STOP_GRACE_S = 3.0   # after SIGTERM a process drains for at most this long, then exits anyway


def tied_env(tied: bool = True) -> dict[str, str]:
    """The environment for a child: with this process's pid when the child must die with it."""
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    if tied:
        env[PARENT_ENV] = str(os.getpid())
    return env


def watch_parent(name: str) -> int | None:
    """Tie this process to the parent named in PARENT_ENV (if any); returns that pid."""
    value = os.environ.pop(PARENT_ENV, None)
    if not value:
        return None
    parent = int(value)
    if os.getppid() != parent:   # the parent died before we got here: nobody will stop us
        logger.error("{}: parent {} is gone before start; exiting", name, parent)
        os._exit(1)
    threading.Thread(target=_wait_for_exit, args=(parent, name), name="parent-watch", daemon=True).start()
    return parent


def _wait_for_exit(parent: int, name: str) -> None:
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):
        fd = None
    if fd is not None and os.getppid() == parent:   # (a pidfd taken after the parent died is no use)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll()   # blocks until the parent exits
    else:   # no pidfd (old kernel): one cheap check a second
        while os.getppid() == parent:
            time.sleep(1.0)
    logger.error("{}: parent {} exited; stopping", name, parent)
    os.kill(os.getpid(), signal.SIGTERM)


def arm_hard_exit(name: str, grace_s: float = STOP_GRACE_S) -> None:
    """After a stop request: exit no later than `grace_s` from now even if draining hangs
    (a compile, a join, a blocked send)."""
    def hard_exit() -> None:
        logger.error("{} did not stop within {:g} s of SIGTERM; exiting now", name, grace_s)
        os._exit(143)

    timer = threading.Timer(grace_s, hard_exit)
    timer.daemon = True
    timer.start()


def settle_heap(collect: bool = True) -> int:
    """Move every object alive now out of reach of the cyclic collector's full passes; returns how many.

    A stage or driver keeps what it loaded and compiled for its whole life, and JAX's traces and
    caches are millions of objects: a full (generation 2) collection over them holds the GIL for
    seconds on a busy 2-core machine (1.75 s measured), which stalls the heartbeat thread past
    `dead_after_s` and makes a healthy stage look dead. `gc.freeze()` parks them in the permanent
    generation, so later full passes scan only what came after. `collect`: free the garbage first,
    a full pass, where a pause is harmless (before READY, when a driver starts); without it (after
    each warm-up compile of a serving stage) garbage alive now would stay, but a compile leaves
    none that a full pass finds (0 collected, measured).
    """
    import gc

    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
