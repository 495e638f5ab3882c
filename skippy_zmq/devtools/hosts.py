"""Unequal "hosts" on one machine, for tests and `bench cluster`: each host's processes run in a
cgroup v1 `cpu` controller with a CPU quota (a slow host), optionally in a network namespace of
its own hanging off a bridge, its link shaped with `tc tbf` (a thin link).

The quota is `cpu.cfs_quota_us` over the shortest `cpu.cfs_period_us` the kernel takes for it
(`period_us`: the quota at least 1 ms, the period at least 1 ms): a host at 25% of a core runs
1 ms in every 4, at 50% 1 ms in every 2, evenly slow, where the kernel's default 100 ms period
lets a 25% host run 25 ms flat out and then stall for 75 (bursty as well as slow, which
exaggerates what a slower machine does to a pipeline). A 10 ms period still did that at the
scale of one token: a step that spent the budget waited up to 7.5 ms for its reply to be sent
(the socket's I/O thread is in the same group), and a 1-stream token's time moved with the
phase of the ring against the period (the even split 20-38 ms by the order of its hosts). A group
of a whole core or more keeps a 10 ms period: its one-thread step never spends the budget, and
at 1 ms the budget split between the machine's cores throttled it whenever a thread woke on the
other core (h100's layer 0.39 ms where 10 ms gives 0.27, its head 5.5 ms where it gives 2.3).
The socket I/O threads (`IoThreads`) run outside the quota: on a slower machine a reply leaves
when it is ready, where in the group it waited for the next period whenever the step had spent
the budget (up to 3 ms at 25%; 0.3% of a host's CPU, so its speed is the quota's). A process joins its host by a shell that writes its own pid
to the group's cgroup.procs and then execs the command (`Hosts.wrap`), so the pid a caller holds
is the command's and nothing polls.

Needs root: a writable /sys/fs/cgroup/cpu (cgroup v1), and for namespaces iproute2 and
CAP_NET_ADMIN; `cpu_cgroup_problem()` / `netns_problem()` say why not, for a skip or a fallback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from skippy_zmq.config.cpus import JAX_THREADS_ENV, THREADS_ENV, cpu_threads, usable_cpus

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
# cpu.shares: on a shared machine (a load average of 10-40 on 2 cores while this was written) a
# group weighted like one task gets a sliver of a core and its quota never binds, so every "host"
# runs at the same crowded speed; weighted like SHARES tasks, each gets its quota and no more.
SHARES = 64 * 1024
MIN_QUOTA_US = 1_000     # the kernel refuses a smaller cfs_quota_us
MIN_PERIOD_US = 1_000    # ... and a shorter cfs_period_us
CORE_PERIOD_US = 10_000  # a group of a core or more (module docstring)


def period_us(cores: float) -> int:
    """The shortest period whose share `cores` the kernel takes as a quota, for a share under a
    core; a core or more keeps 10 ms (module docstring)."""
    if cores >= 1:
        return CORE_PERIOD_US
    return max(MIN_PERIOD_US, -(-MIN_QUOTA_US * 1000 // max(1, round(cores * 1000))))


@dataclass(frozen=True)
class HostSpec:
    name: str
    cpu: float | None = None      # cores (0.25 = a quarter of one); None: uncapped
    rate: str | None = None       # tc tbf rate of its link, e.g. "100mbit"; None: unshaped (netns only)
    shares: int | None = None     # cpu.shares (weight against other groups and root's tasks); None: 1024


def cpu_cgroup_problem(root: Path = CPU_ROOT) -> str | None:
    """Why CPU-quota hosts cannot be made here (None when they can)."""
    if not (root / "cpu.cfs_quota_us").is_file():
        return f"no cgroup v1 cpu controller at {root} (cpu.cfs_quota_us missing)"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (needs root)"
    return None


def netns_problem() -> str | None:
    """Why network namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"skzprobe{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"`ip netns add` failed: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {out.stderr.strip()}")
    return out


class CpuGroup:
    """One cgroup v1 `cpu` group capped at `cores` (None: no cap), removed by `remove()`."""

    def __init__(self, name: str, cores: float | None, root: Path = CPU_ROOT, shares: int | None = None):
        self.path = root / name
        self.root = root
        self.path.mkdir(exist_ok=True)
        if shares is not None:   # on a busy machine a group gets its quota only if its weight wins it
            (self.path / "cpu.shares").write_text(f"{shares}\n")
        self.set_cores(cores)

    def set_cores(self, cores: float | None) -> None:
        """Cap the group at `cores` (None: uncapped) over its shortest period (`period_us`)."""
        period = period_us(cores or 1.0)
        (self.path / "cpu.cfs_quota_us").write_text("-1\n")    # a period is refused under a larger quota
        (self.path / "cpu.cfs_period_us").write_text(f"{period}\n")
        quota = -1 if cores is None else max(MIN_QUOTA_US, round(cores * period))
        (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def quota_cores(self) -> float | None:
        quota = int((self.path / "cpu.cfs_quota_us").read_text())
        return None if quota < 0 else quota / int((self.path / "cpu.cfs_period_us").read_text())

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def throttled(self) -> dict[str, int]:
        """cpu.stat: nr_periods, nr_throttled, throttled_time (ns)."""
        stat = {}
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            stat[key] = int(value)
        return stat

    def adopt(self, pid: int) -> None:
        """Move process `pid` (all its threads) into this group."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """argv run inside this group: the shell moves itself in, then execs argv (same pid), its
        JAX pool sized by the group's quota (config/cpus.py): a process that argv puts in a network
        namespace (`ip netns exec`) sees no cgroup folders to read its quota from."""
        cores = self.quota_cores()
        env = [] if cores is None or os.environ.get(THREADS_ENV) else ["env", f"{JAX_THREADS_ENV}={cpu_threads(cores, usable_cpus())}"]
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *env, *argv]

    def remove(self) -> None:
        """Move whatever is still inside back to the root group, then remove the group."""
        if not self.path.exists():
            return
        for pid in self.pids():
            try:
                (self.root / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                pass   # gone meanwhile
        self.path.rmdir()


class IoThreads:
    """Moves the ZeroMQ I/O threads (`ZMQbg/...`) of every process in `groups` into an uncapped
    group of their own (cgroup v1 places threads one by one), looking every `interval` s from a
    thread of this process until `stop()` (module docstring)."""

    def __init__(self, groups: Sequence[CpuGroup], name: str, interval: float = 0.2):
        self.groups, self.interval = list(groups), interval
        self.group = CpuGroup(name, None, root=self.groups[0].root, shares=SHARES)
        self.moved: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="io-threads", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for group in self.groups:
                try:
                    pids = group.pids()
                except OSError:   # removed meanwhile
                    continue
                for pid in pids:
                    self._move(pid)

    def _move(self, pid: int) -> None:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            tid = int(task.name)
            try:
                if tid not in self.moved and (task / "comm").read_text().startswith("ZMQbg"):
                    (self.group.path / "tasks").write_text(f"{tid}\n")
                    self.moved.add(tid)
            except (OSError, ValueError):   # gone meanwhile
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.group.remove()


class Hosts:
    """`specs` as hosts: a CPU group each (when `cpu` is set) and, with `netns`, a namespace each
    on a bridge (10.SUBNET.0/24: the bridge, where the driver lives, is .1, host i is .2+i) with
    its link shaped by `rate`. A context manager; everything made is removed on exit."""

    def __init__(self, specs: Sequence[HostSpec], netns: bool = False, tag: str | None = None):
        self.specs, self.netns = list(specs), netns
        self.tag = tag or f"skh{os.getpid() % 100000}"
        self.subnet = f"10.202.{os.getpid() % 200 + 20}"
        self.groups: list[CpuGroup | None] = []
        self._made_bridge = False
        self._thin: set[int] = set()   # hosts whose side of a thin pair is shaped (thin_pair)
        self.io: IoThreads | None = None

    def __enter__(self) -> Hosts:
        try:
            for i, spec in enumerate(self.specs):
                self.groups.append(CpuGroup(f"{self.tag}-{i}", spec.cpu, shares=spec.shares)
                                   if spec.cpu is not None or spec.shares is not None else None)
            capped = [g for g in self.groups if g is not None and g.quota_cores() is not None]
            if capped:
                self.io = IoThreads(capped, f"{self.tag}-io")
            if self.netns:
                self._network()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def bridge(self) -> str:
        return f"{self.tag}b"

    def namespace(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def address(self, i: int) -> str:
        """Where host i listens: its namespace's address, or loopback without namespaces."""
        return f"{self.subnet}.{2 + i}" if self.netns else "127.0.0.1"

    @property
    def driver_address(self) -> str:
        return f"{self.subnet}.1" if self.netns else "127.0.0.1"

    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, spec in enumerate(self.specs):
            ns, outer, inner = self.namespace(i), f"{self.tag}o{i}", f"{self.tag}i{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", outer, "master", self.bridge)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if spec.rate:   # both directions: into the host (the bridge's side) and out of it
                for dev, where in ((outer, ()), (inner, ("-n", ns))):
                    _run("tc", *where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", spec.rate,
                         "burst", "64kb", "latency", "100ms")

    def thin_pair(self, i: int, j: int, rate: str) -> None:
        """Shape only the link between hosts i and j (both directions) to `rate` (tc tbf), leaving
        their links to the bridge (the driver) and to other hosts as they are: on each one's side a
        prio qdisc whose third band (which ordinary traffic never takes) is the tbf, and a u32
        filter sending what goes to the other's address there. One thin pair per host."""
        for a, b in ((i, j), (j, i)):
            if a in self._thin:
                raise ValueError(f"host {a} already has a thin pair (one per host)")
            self._thin.add(a)
            tc = ("ip", "netns", "exec", self.namespace(a), "tc")
            dev = f"{self.tag}i{a}"
            _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            for cls in ("1:10", "1:20"):
                _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", "10gbit")
            _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "tbf", "rate", rate,
                 "burst", "16kb", "latency", "400ms")
            _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", "dst", f"{self.address(b)}/32", "flowid", "1:20")

    def wrap(self, i: int, argv: Sequence[str]) -> list[str]:
        """argv as host i runs it: in its CPU group, then its namespace (`ip netns exec` execs, and
        mounts a sysfs of the namespace's own, where the cgroup folders are not: so the group first)."""
        group = self.groups[i] if i < len(self.groups) else None
        argv = ["ip", "netns", "exec", self.namespace(i), *argv] if self.netns else list(argv)
        return group.wrap(argv) if group is not None else argv

    def close(self) -> None:
        if self.io is not None:
            self.io.stop()
            self.io = None
        if self.netns:
            for i in range(len(self.specs)):
                _run("ip", "netns", "del", self.namespace(i), check=False)
            if self._made_bridge:
                _run("ip", "link", "del", self.bridge, check=False)
        for group in self.groups:
            if group is not None:
                group.remove()
        self.groups = []


@contextmanager
def driver_group(tag: str) -> Iterator[None]:
    """This process (the driver) in an uncapped group weighted as the hosts are, back in the root after."""
    group = CpuGroup(f"{tag}-driver", None, shares=SHARES)
    group.adopt(os.getpid())
    try:
        yield
    finally:
        group.remove()
