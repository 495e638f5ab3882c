"""Unequal hosts on one machine (skippy_zmq/devtools/hosts.py): a process in a CPU-quota cgroup
is inside it and throttled; a host in a namespace runs there, its link under a tbf qdisc. Needs
root and the cgroup v1 cpu controller (and iproute2 for namespaces); skips naming what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_zmq.devtools.hosts import Hosts, HostSpec, cpu_cgroup_problem, netns_problem

# Burns CPU until this process has used 0.3 s of it, then prints its own cgroup line.
BURN = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
        "print(open('/proc/self/cgroup').read())")


@pytest.fixture()
def cgroups():
    problem = cpu_cgroup_problem()
    if problem:
        pytest.skip(f"cannot make CPU-quota hosts here: {problem}")


def test_a_quota_host_runs_its_process_in_its_group_throttled(cgroups):
    with Hosts([HostSpec("slow", cpu=0.25), HostSpec("free")]) as hosts:
        group = hosts.groups[0]
        assert group.quota_cores() == 0.25
        assert int((group.path / "cpu.cfs_period_us").read_text()) == 4000   # 1 ms in every 4
        group.set_cores(0.5)
        assert (int((group.path / "cpu.cfs_period_us").read_text()), group.quota_cores()) == (2000, 0.5)
        group.set_cores(0.25)
        assert hosts.groups[1] is None                     # uncapped: no group at all
        out = subprocess.run(hosts.wrap(0, [sys.executable, "-c", BURN]), capture_output=True, text=True,
                             timeout=60, check=True)
        assert f"cpu:/{group.path.name}" in out.stdout.replace(",cpuacct", "")
        stat = group.throttled()
        assert stat["nr_throttled"] > 0, stat              # 0.3 s of CPU at 1 ms per 4 ms
        path = group.path
    assert not path.exists()


def test_a_host_in_a_namespace_with_a_shaped_link(cgroups):
    problem = netns_problem()
    if problem:
        pytest.skip(f"cannot make network namespaces here: {problem}")
    with Hosts([HostSpec("a", cpu=0.5, rate="50mbit"), HostSpec("b", cpu=1.0)], netns=True) as hosts:
        out = subprocess.run(hosts.wrap(0, ["sh", "-c", "readlink /proc/self/ns/net; cat /proc/self/cgroup"]),
                             capture_output=True, text=True, timeout=30, check=True).stdout
        inode = os.stat(f"/run/netns/{hosts.namespace(0)}").st_ino
        assert out.splitlines()[0] == f"net:[{inode}]"                    # in host 0's namespace
        assert f"cpu:/{hosts.groups[0].path.name}" in out.replace(",cpuacct", "")   # and its CPU group
        qdisc = subprocess.run(["tc", "-n", hosts.namespace(0), "qdisc", "show"], capture_output=True, text=True,
                               timeout=30).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc, qdisc
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert hosts.namespace(0) not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                    timeout=30).stdout
    assert hosts.namespace(0) in names


def test_the_period_is_the_shortest_the_kernel_takes_for_the_share():
    from skippy_zmq.devtools.hosts import period_us

    # the kernel takes no quota and no period under 1 ms: a share under a core gets 1 ms ÷ share;
    # a core or more, 10 ms
    assert [period_us(c) for c in (2.0, 1.0, 0.999, 0.75, 0.5, 0.3, 0.25, 0.1, 0.05)] == \
        [10000, 10000, 1002, 1334, 2000, 3334, 4000, 10000, 20000]


# A process with a ZeroMQ socket: its I/O threads start with the socket.
ZMQ_PROCESS = ("import time, zmq\nsocket = zmq.Context().socket(zmq.PUSH)\nsocket.bind('tcp://127.0.0.1:0')\n"
               "print('up', flush=True)\ntime.sleep(60)")


def test_a_quota_hosts_socket_threads_run_outside_its_quota(cgroups):
    import time

    with Hosts([HostSpec("slow", cpu=0.25)]) as hosts:
        proc = subprocess.Popen(hosts.wrap(0, [sys.executable, "-c", ZMQ_PROCESS]), stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "up\n"
            io = hosts.io.group
            deadline = time.monotonic() + 30
            while len((io.path / "tasks").read_text().split()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            names = sorted(Path(f"/proc/{proc.pid}/task/{t}/comm").read_text().strip()
                           for t in (io.path / "tasks").read_text().split())
            assert names == ["ZMQbg/IO/0", "ZMQbg/Reaper"]
            assert [int(t) for t in (hosts.groups[0].path / "tasks").read_text().split()] == [proc.pid]
        finally:
            proc.kill()
            proc.wait(timeout=30)
        path = io.path
    assert not path.exists()
