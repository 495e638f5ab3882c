"""Multi-host on one machine: every stage in a network namespace of its own.

Three namespaces hang off a bridge in the root namespace (10.201.N.0/24; the
bridge is .1, stage i is .2+i). Stage i runs inside namespace i and listens
on its namespace's address; the driver runs in this (root) namespace and binds
its return endpoint on the bridge address. The topology is the ordinary file
format with real, non-loopback hosts, so nothing can take a loopback shortcut:
activations cross namespace 0 -> 1 -> 2 over the bridge and tokens come back
to the root namespace. Needs root (CAP_NET_ADMIN) and iproute2; skips otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, first_mismatch
from procs import TEST_CONTEXT
from skippy_zmq.engine.request import GenRequest
from skippy_zmq.ops.launch import check_alive, prepare_keys, stop_processes
from skippy_zmq.config.topology_yaml import load_topology, plan_topology

N_STAGES = 3
PID = os.getpid()
SUBNET = f"10.201.{PID % 200 + 20}"          # a private /24 unlikely to clash with a concurrent run
BRIDGE = f"skb{PID}"                          # interface names stay under 15 characters
PORT = 5601                                   # each namespace has its own port space


def namespace(i: int) -> str:
    return f"skz{PID}-{i}"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def teardown_network() -> None:
    """Delete what setup_network made; deleting a namespace deletes the veth pair inside it."""
    for i in range(N_STAGES):
        ip("netns", "del", namespace(i), check=False)
    ip("link", "del", BRIDGE, check=False)


def setup_network() -> list[str]:
    """Bridge + one namespace per stage; returns the stage addresses."""
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    addresses = []
    for i in range(N_STAGES):
        ns, outer, inner, address = namespace(i), f"skv{PID}{i}", f"skp{PID}{i}", f"{SUBNET}.{2 + i}"
        ip("netns", "add", ns)
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", outer, "master", BRIDGE)
        ip("link", "set", outer, "up")
        ip("link", "set", inner, "netns", ns)
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        ip("-n", ns, "link", "set", inner, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        addresses.append(address)
    return addresses


@pytest.fixture()
def network():
    if shutil.which("ip") is None:
        pytest.skip("cannot create network namespaces here: iproute2 (`ip`) is not installed")
    probe = subprocess.run(["ip", "netns", "add", namespace(0)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {probe.stderr.strip()}")
    ip("netns", "del", namespace(0))
    try:
        yield setup_network()
    finally:
        teardown_network()


def write_netns_topology(tmp: Path, model_dir: Path, addresses: list[str]) -> Path:
    data = plan_topology(30, N_STAGES, model=str(model_dir)).to_dict()
    data["driver"]["return"] = f"tcp://{SUBNET}.1:{free_port()}"
    data["driver"]["http"] = "127.0.0.1:1"     # the driver here is in-process; no HTTP server is started
    data["driver"]["max_context"] = TEST_CONTEXT   # the suite's stage shapes (procs.TEST_CONTEXT)
    for stage, address in zip(data["stages"], addresses):
        stage["listen"] = f"tcp://{address}:{PORT}"
        stage["host"] = address
    path = tmp / "netns.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((f"{SUBNET}.1", 0))
        return s.getsockname()[1]


def established(pid: int) -> set[tuple[str, int, str, int]]:
    """(local ip, port, remote ip, port) of every ESTABLISHED IPv4 TCP socket in pid's namespace."""
    def addr(text: str) -> tuple[str, int]:
        host, port = text.split(":")
        return ".".join(str(b) for b in bytes.fromhex(host)[::-1]), int(port, 16)
    out = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01":
            out.add((*addr(fields[1]), *addr(fields[2])))
    return out


def spawn_in_namespaces(topology, path: Path, run_dir: Path) -> list[subprocess.Popen]:
    """Stage i inside namespace i, last stage first (as launch.spawn_stages does, CURVE keys first)."""
    prepare_keys(path)
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in reversed(range(N_STAGES)):
        stage = topology.stages[i]
        with open(run_dir / f"{stage.id}.log", "ab") as log:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", namespace(i), sys.executable, "-m", "skippy_zmq.cli", "--log-level", "INFO",
                 "stage", "--topology", str(path), "--stage", stage.id],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True))
    return procs


def test_three_stages_in_three_namespaces_match_transformers(network, model_dir, parity, tmp_path):
    from skippy_zmq.api.main import open_engine

    path = write_netns_topology(tmp_path, model_dir, network)
    topology = load_topology(path)
    assert [s.host for s in topology.stages] == network
    run_dir = tmp_path / "run"
    procs = spawn_in_namespaces(topology, path, run_dir)
    engine = None
    try:
        engine, _ = open_engine(topology)
        deadline = time.monotonic() + 240
        while not engine.wait_ready(0.5):
            check_alive(procs, run_dir)
            assert time.monotonic() < deadline, engine.not_ready_reason()
        # `ip netns exec` execs the stage, so each pid is the stage itself, inside its namespace.
        for i, proc in enumerate(reversed(procs)):
            assert ip("netns", "identify", str(proc.pid)).stdout.strip() == namespace(i)
        case = parity["prompts"][0]
        t0 = time.monotonic()
        events = list(engine.generate_blocking(GenRequest("netns", tuple(case["prompt_ids"]), max_tokens=16,
                                                          ignore_eos=True, timeout_s=120)))
        tokens = [e.token_id for e in events if e.token_id is not None]
        print(f"\nnetns: 3 stages in 3 namespaces, 16 tokens in {time.monotonic() - t0:.2f} s")
        assert first_mismatch(tokens, case["transformers_fp32_ids"]) == 16, (tokens, case["transformers_fp32_ids"])
        assert events[-1].finish_reason == "length"
        # The chain really crossed namespaces: stage i talks TCP to the driver on the bridge and to
        # its neighbours' addresses (/proc/PID/net/tcp lists the sockets of PID's namespace).
        return_port = int(topology.driver.return_endpoint.rsplit(":", 1)[1])
        for i, proc in enumerate(reversed(procs)):
            peers = established(proc.pid)
            assert (f"{network[i]}", f"{SUBNET}.1", return_port) in {(l, r, rp) for l, _, r, rp in peers}, peers
            if i + 1 < N_STAGES:
                assert any(r == network[i + 1] and rp == PORT for _, _, r, rp in peers), peers
    finally:
        if engine is not None:
            engine.close()
        stop_processes(procs)
