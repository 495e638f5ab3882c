"""Worker-to-worker links (skippy_zmq/cluster/peers.py): a worker's probe endpoint answers only
the keys the driver admits, every input capped; measured pairs win over the guess from the driver
links in ops/speed.py; and with real network namespaces, a thin tc link between two hosts whose
links to the driver are fat is measured as thin and the planner keeps those two apart."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import zmq

from skippy_zmq.cluster import link
from skippy_zmq.cluster.peers import (ProbeServer, allow_keys, measure_peer, pair_links, peers_of, probe_requests,
                                      probed_links)
from skippy_zmq.cluster.probe import MAX_PROBE_BYTES
from skippy_zmq.cluster.split import links_of
from skippy_zmq.ops.speed import DRIVER, HostSpeed, Links, plan_split


def keypair() -> tuple[bytes, bytes]:
    return zmq.curve_keypair()


def test_the_probe_answers_an_admitted_key_and_refuses_any_other():
    admitted, stranger, later = keypair(), keypair(), keypair()
    server = ProbeServer([admitted[0]], "tcp://127.0.0.1:0")
    try:
        endpoint = f"tcp://127.0.0.1:{server.port}"
        found = measure_peer(endpoint, server.key, *admitted, transfer_bytes=64 << 10)
        assert found["rtt_ms"] > 0 and found["bytes_per_s"] > 0 and found["transfer_bytes"] == 64 << 10
        refused = measure_peer(endpoint, server.key, *stranger, transfer_bytes=1024, timeout_s=1.0)
        assert "no answer" in refused["error"] and "rtt_ms" not in refused
        assert server.auth.rejected >= 1
        server.allow([later[0]])          # a PROBE names the driver's other tokens' keys
        assert measure_peer(endpoint, server.key, *later, transfer_bytes=1024)["rtt_ms"] > 0
    finally:
        server.close()


def test_the_probe_drops_what_breaks_its_rules_and_goes_on():
    client = keypair()
    server = ProbeServer([client[0]], "tcp://127.0.0.1:0")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = client[0], client[1], server.key
    try:
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        for bad in (link.Message("PING", {"size": MAX_PROBE_BYTES + 1}), link.Message("FETCH", {"path": "x"}),
                    link.Message("PING", {"size": "many"})):
            sock.send_multipart(link.frames(bad))
        sock.send_multipart(link.frames(link.Message("PING", {"size": 3})))
        assert sock.poll(10_000), "no PONG after the bad requests"
        pong = link.parse(sock.recv_multipart())
        assert pong.kind == "PONG" and bytes(pong.data) == b"\0\0\0"
        assert server.dropped == 3 and server.answered == 1
    finally:
        sock.close(linger=0)
        ctx.term()
        server.close()


def test_a_peer_endpoint_zmq_cannot_dial_is_that_peers_error():
    public, secret = keypair()
    found = measure_peer("tcp://no-port-here", public, public, secret, transfer_bytes=1024, timeout_s=0.5)
    assert found == {"error": "Invalid argument (addr='tcp://no-port-here')"}


def test_probe_messages_are_checked_and_capped():
    a, b = "A" * 40, "B" * 40
    asks = probe_requests({"w1": ("10.0.0.2", {"port": 4000, "key": a}), "w2": ("10.0.0.3", {"port": 4001, "key": b}),
                           "w3": ("10.0.0.4", None)}, [b"K" * 40])
    assert set(asks) == {"w1", "w2"}      # w3 reported no probe endpoint: neither probes nor is probed
    assert asks["w1"]["peers"] == [{"name": "w2", "endpoint": "tcp://10.0.0.3:4001", "key": b}]
    assert asks["w2"]["allow"] == ["K" * 40]
    assert probe_requests({"w1": ("10.0.0.2", {"port": 4000, "key": a})}, []) == {}
    assert peers_of(link.Message("PROBE", asks["w1"])) == [("w2", "tcp://10.0.0.3:4001", b.encode())]
    with pytest.raises(link.LinkError, match="cap 64"):
        peers_of(link.Message("PROBE", {"peers": [asks["w1"]["peers"][0]] * 65}))
    with pytest.raises(link.LinkError, match="bad endpoint or key"):
        peers_of(link.Message("PROBE", {"peers": [{"name": "x", "endpoint": "ipc:///tmp/x", "key": a}]}))
    with pytest.raises(link.LinkError, match="40 characters"):
        allow_keys(link.Message("PROBE", {"allow": ["short"]}))
    got = probed_links(link.Message("PROBED", {"links": {"w2": {"rtt_ms": 0.5, "bytes_per_s": 1e6, "x": "y"},
                                                         "w3": {"error": "no answer"}}}))
    assert got == {"w2": {"rtt_ms": 0.5, "bytes_per_s": 1e6}, "w3": {"error": "no answer"}}
    with pytest.raises(link.LinkError, match="not an object"):
        probed_links(link.Message("PROBED", {"links": {"w2": 3}}))


def test_measured_pairs_win_over_the_guess_from_the_driver_links():
    fat = {"rtt_ms": 0.2, "bytes_per_s": 1e9}
    reports = {n: {"links": {"driver": fat}} for n in ("a", "b", "c")}
    guessed = links_of(reports)
    assert guessed.ms("a", "b", 2304) == pytest.approx(0.1 + 2304 / 1e6)
    probed = {"a": {"b": {"rtt_ms": 4.0, "bytes_per_s": 2.5e5}, "c": {"error": "no answer"}},
              "b": {"a": {"rtt_ms": 6.0, "bytes_per_s": 5e5}}}
    assert pair_links(probed) == {("b", "a"): {"rtt_ms": 4.0, "bytes_per_s": 2.5e5},
                                  ("a", "b"): {"rtt_ms": 6.0, "bytes_per_s": 5e5}}
    links = links_of(reports, probed)
    assert links.ms("b", "a", 2304) == pytest.approx(2.0 + 2304 / 250)    # PONG's bytes went b -> a
    assert links.ms("a", "b", 2304) == pytest.approx(3.0 + 2304 / 500)
    assert links.ms("a", "c", 2304) == guessed.ms("a", "c", 2304)          # not measured: the guess
    assert links.ms(DRIVER, "a") == guessed.ms(DRIVER, "a")


def equal_hosts(names: list[str]) -> list[HostSpeed]:
    return [HostSpeed(n, (1,), (1.0,), (0.5,), (2.0,)) for n in names]


def thin_pair_plan(links: Links) -> list[str]:
    return [s.host for s in plan_split(equal_hosts(["h0", "h1", "h2"]), 12, lambda a, b: 0, links, "latency",
                                       n_stages=3, row_bytes=2304).stages]


def test_the_planner_keeps_two_hosts_with_a_thin_link_apart():
    fat = {n: {"rtt_ms": 0.1, "bytes_per_s": 1e9} for n in ("h0", "h1", "h2")}
    thin = {("h0", "h1"): {"rtt_ms": 0.3, "bytes_per_s": 2.5e5}}
    order = thin_pair_plan(Links.from_driver_links(fat, pairs=thin))
    assert order in (["h0", "h2", "h1"], ["h1", "h2", "h0"]), order


# ---------------------------------------------------------------- real namespaces, a thin tc link

SERVE = ("import sys; from skippy_zmq.cluster.peers import ProbeServer; "
         "s = ProbeServer([k.encode() for k in sys.argv[2:]], sys.argv[1]); print(s.key.decode(), flush=True); "
         "sys.stdin.read(); s.close()")
MEASURE = ("import json, sys; from skippy_zmq.cluster.peers import measure_peer; "
           "print(json.dumps(measure_peer(sys.argv[1], sys.argv[2].encode(), sys.argv[3].encode(), "
           "sys.argv[4].encode(), transfer_bytes=256 << 10)))")


@pytest.fixture()
def namespaces():
    from skippy_zmq.devtools.hosts import netns_problem

    problem = netns_problem()
    if problem:
        pytest.skip(f"cannot make network namespaces here: {problem}")


def test_a_thin_link_between_two_hosts_is_measured_and_planned_around(namespaces):
    """Three hosts on a bridge, each with a fat link to the driver; only h0 <-> h1 is shaped to
    2 mbit (tc tbf). Probe servers in each namespace, each host measures the others from inside
    its own, the driver (this process) measures each; the planner keeps h0 and h1 apart, where the
    guess from the driver links (all fat) saw no difference between the orders."""
    from skippy_zmq.devtools.hosts import Hosts, HostSpec

    client = keypair()
    with Hosts([HostSpec("h0"), HostSpec("h1"), HostSpec("h2")], netns=True) as hosts:
        hosts.thin_pair(0, 1, "2mbit")
        names = [s.name for s in hosts.specs]
        servers, keys = [], {}
        try:
            for i, name in enumerate(names):
                argv = hosts.wrap(i, [sys.executable, "-c", SERVE, f"tcp://{hosts.address(i)}:5700",
                                      client[0].decode()])
                servers.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                keys[name] = servers[-1].stdout.readline().strip()
            endpoint = {n: f"tcp://{hosts.address(i)}:5700" for i, n in enumerate(names)}
            driver = {n: measure_peer(endpoint[n], keys[n].encode(), *client, transfer_bytes=256 << 10)
                      for n in names}
            probed = {}
            for i, name in enumerate(names):
                probed[name] = {}
                for other in names:
                    if other != name:
                        argv = hosts.wrap(i, [sys.executable, "-c", MEASURE, endpoint[other], keys[other],
                                              client[0].decode(), client[1].decode()])
                        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
                        probed[name][other] = json.loads(out.stdout)
        finally:
            for proc in servers:
                proc.stdin.close()
                proc.wait(timeout=10)
    assert all("rtt_ms" in d for d in driver.values()), driver
    thin = [probed["h0"]["h1"]["bytes_per_s"], probed["h1"]["h0"]["bytes_per_s"]]
    fat = [probed["h0"]["h2"]["bytes_per_s"], probed["h2"]["h1"]["bytes_per_s"],
           *(d["bytes_per_s"] for d in driver.values())]
    assert max(thin) < 400_000 < 10 * max(thin) < min(fat), (thin, fat)   # 2 mbit = 250 kB/s
    reports = {n: {"links": {"driver": driver[n]}} for n in names}
    order = thin_pair_plan(links_of(reports, probed))
    assert order in (["h0", "h2", "h1"], ["h1", "h2", "h0"]), order
    guess = links_of(reports)        # without the pairs every hop looks fat: h0 next to h1 costs nothing more
    assert guess.ms("h0", "h1", 2304) < 1.0 < links_of(reports, probed).ms("h0", "h1", 2304)
