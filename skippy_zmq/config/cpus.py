"""How many CPU threads this process can keep busy: the CPUs it may run on (sched_getaffinity),
capped by the CPU quota over its cgroup, rounded up (`cpu_threads`): a process under a quota of a
quarter of a core gets one thread, not one per CPU of the machine.

Why: XLA's CPU client sizes its intra-op pool, the pool the native kernel (model/kernel.py) shares
a large call's tasks over, by the CPUs the process may run on, blind to a quota. Two threads under
a quarter of a core spend the period's budget twice as fast while they run and then both stall,
and ops/speed.py's time model counts a step as one thread's work. `size_jax_threads` sets
PJRT_NPROC, which the CPU client reads for its pool size when JAX starts it, so the pool (and with
it the kernel's helpers) is what the quota pays for.

The quota: cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` or v2 `cpu.max`, of the process's
own group (/proc/self/cgroup) and every group above it (the tightest binds). A process inside
`ip netns exec` sees a sysfs of its namespace's own, without the cgroup folders: whoever starts it
there passes PJRT_NPROC (devtools/hosts.py does).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping, MutableMapping

JAX_THREADS_ENV = "PJRT_NPROC"     # XLA's CPU client: its intra-op pool's size (read when JAX starts it)
THREADS_ENV = "SKIPPY_CPU_THREADS"   # an operator's pool size, quota or not (e.g. 2 under a 1-core quota)
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_DIRS = ("cpu", "cpu,cpuacct")   # where a v1 `cpu` controller is mounted under CGROUP_ROOT
V2_DIRS = ("", "unified")          # the v2 hierarchy: the root itself, or beside v1 (hybrid)


def cpu_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> tuple[float, float] | None:
    """(cores, period in ms) of the tightest CPU quota over this process's cgroup and its
    ancestors, None when uncapped or unreadable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2]
        if "cpu" in controllers.split(","):
            found += [_v1_quota(root / d, path) for d in V1_DIRS]
        elif controllers == "":
            found += [_v2_quota(root / d if d else root, path) for d in V2_DIRS]
    quotas = [q for q in found if q is not None]
    return min(quotas) if quotas else None


def _groups(mount: Path, path: str) -> list[Path]:
    """The group at `path` under `mount` and each one above it, up to the mount."""
    parts = [p for p in path.strip().split("/") if p]
    return [mount.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def _v1_quota(mount: Path, path: str) -> tuple[float, float] | None:
    quotas = []
    for group in _groups(mount, path):
        try:
            quota = int((group / "cpu.cfs_quota_us").read_text())
            period = int((group / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            quotas.append((quota / period, period / 1000))
    return min(quotas) if quotas else None


def _v2_quota(mount: Path, path: str) -> tuple[float, float] | None:
    quotas = []
    for group in _groups(mount, path):
        try:
            text = (group / "cpu.max").read_text().split()
            quota, period = (-1 if text[0] == "max" else int(text[0])), int(text[1])
        except (OSError, ValueError, IndexError):
            continue
        if quota > 0 and period > 0:
            quotas.append((quota / period, period / 1000))
    return min(quotas) if quotas else None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads(quota_cores: float | None, usable: int) -> int:
    """Threads worth running: ceil(quota) (a quarter of a core: one), no more than the usable
    CPUs, at least one. None: no quota."""
    usable = max(1, usable)
    if quota_cores is None or quota_cores <= 0:
        return usable
    return max(1, min(usable, math.ceil(round(quota_cores, 6))))


def threads_here(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int:
    """cpu_threads for this process: its quota and its affinity."""
    quota = cpu_quota(proc_cgroup, root)
    return cpu_threads(None if quota is None else quota[0], usable_cpus())


def jax_threads(environ: Mapping[str, str] = os.environ) -> int:
    """The pool JAX's CPU client starts (or started) with: PJRT_NPROC where set, else the usable CPUs."""
    given = environ.get(JAX_THREADS_ENV, "").strip()
    return int(given) if given.isdigit() and int(given) > 0 else usable_cpus()


def size_jax_threads(environ: MutableMapping[str, str] = os.environ, threads: int | None = None) -> int:
    """Set PJRT_NPROC in `environ` to `threads` (default threads_here()) where that is fewer than
    the usable CPUs or than a PJRT_NPROC already set (an operator's smaller pool stays), or to
    SKIPPY_CPU_THREADS where that is set (it wins); returns the pool size JAX will start. Call it
    before JAX starts its CPU client, and again after the process's affinity shrinks
    (stage/loop.pin_cpus)."""
    chosen = environ.get(THREADS_ENV, "").strip()
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            raise ValueError(f"{THREADS_ENV} must be a whole number of threads >= 1, got {chosen!r}")
        environ[JAX_THREADS_ENV] = chosen
        return int(chosen)
    want = threads_here() if threads is None else max(1, threads)
    given = environ.get(JAX_THREADS_ENV, "").strip()
    if given.isdigit() and int(given) > 0:
        want = min(want, int(given))
    elif want >= usable_cpus():
        return want   # nothing to cap: XLA sizes its pool by the affinity itself
    environ[JAX_THREADS_ENV] = str(want)
    return want
