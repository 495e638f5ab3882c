"""Unequal hosts on one machine (skippy_zmq/devtools/hosts.py): a process in a CPU-quota cgroup
is inside it and throttled; a host in a namespace runs there, its link under a tbf qdisc. Needs
root and the cgroup v1 cpu controller (and iproute2 for namespaces); skips naming what is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skippy_zmq.devtools.hosts import PERIOD_US, Hosts, HostSpec, cpu_cgroup_problem, netns_problem

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
        assert int((group.path / "cpu.cfs_period_us").read_text()) == PERIOD_US
        assert hosts.groups[1] is None                     # uncapped: no group at all
        out = subprocess.run(hosts.wrap(0, [sys.executable, "-c", BURN]), capture_output=True, text=True,
                             timeout=60, check=True)
        assert f"cpu:/{group.path.name}" in out.stdout.replace(",cpuacct", "")
        stat = group.throttled()
        assert stat["nr_throttled"] > 0, stat              # 0.3 s of CPU at 2.5 ms per 10 ms
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
