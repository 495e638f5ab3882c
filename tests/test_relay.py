"""The delay relay `bench peers` puts between processes (bench/relay.py): bytes arrive intact, in
order, never before their delay, in both directions, and a close passes through."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from skippy_zmq.devtools.bench.relay import relays, serve

DELAY_S = 0.05


def echo_server() -> tuple[socket.socket, int]:
    """A server that echoes every connection until the peer closes its side, then closes."""
    server = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    threading.Thread(target=run, daemon=True).start()
    return server, server.getsockname()[1]


def relay_in_thread(port: int) -> int:
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve, args=(server, "127.0.0.1", port, DELAY_S), daemon=True).start()
    return server.getsockname()[1]


def receive(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def test_a_round_trip_through_the_relay_takes_both_delays_and_keeps_the_bytes():
    server, port = echo_server()
    with server, socket.create_connection(("127.0.0.1", relay_in_thread(port))) as c:
        t0 = time.monotonic()
        c.sendall(b"ping")
        assert receive(c, 4) == b"ping"
        assert time.monotonic() - t0 >= 2 * DELAY_S       # one delay each way, never less
        payload = bytes(range(256)) * 8192                 # 2 MiB, many chunks on the way at once
        sender = threading.Thread(target=c.sendall, args=(payload,))
        sender.start()
        assert receive(c, len(payload)) == payload
        sender.join()
        c.shutdown(socket.SHUT_WR)                         # the close reaches the server, and its close comes back
        assert c.recv(1) == b""


def test_a_connection_to_a_dead_upstream_is_closed_not_held():
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    with socket.create_connection(("127.0.0.1", relay_in_thread(port)), timeout=10) as c:
        assert c.recv(1) == b""


@pytest.mark.slow
def test_the_relay_process_serves_every_route():
    servers = [echo_server() for _ in range(2)]
    ports = []
    for _ in servers:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with relays([(p, "127.0.0.1", port) for p, (_, port) in zip(ports, servers)], DELAY_S * 1000):
        for p in ports:
            with socket.create_connection(("127.0.0.1", p)) as c:
                t0 = time.monotonic()
                c.sendall(b"x" * 100)
                assert receive(c, 100) == b"x" * 100 and time.monotonic() - t0 >= 2 * DELAY_S
    for server, _ in servers:
        server.close()


@pytest.mark.slow
def test_a_pipeline_dialled_through_relays_matches_transformers(model_dir, parity, tmp_path):
    """Every stage and the driver's return endpoint advertised at a relay (the topology's `advertise`
    keys, as `bench peers` runs its 20 ms rows): same tokens, and every token pays the hops' delays,
    so the messages really went through the relays."""
    import yaml

    from conftest import first_mismatch
    from procs import TEST_CONTEXT
    from skippy_zmq.engine.request import GenRequest
    from skippy_zmq.devtools.harness import running_pipeline, write_topology
    from skippy_zmq.config.topology_yaml import load_topology

    path = write_topology(tmp_path, model_dir, 2, driver__max_context=TEST_CONTEXT)
    topology = load_topology(path)
    data = yaml.safe_load(path.read_text())
    fronts = [relay_in_thread(int(e.rsplit(":", 1)[1]))
              for e in [topology.driver.return_endpoint] + [s.listen for s in topology.stages]]
    data["driver"]["return_advertise"] = f"tcp://127.0.0.1:{fronts[0]}"
    for stage, front in zip(data["stages"], fronts[1:]):
        stage["advertise"] = f"tcp://127.0.0.1:{front}"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    case, n = parity["prompts"][0], 8
    with running_pipeline(path, tmp_path / "run") as (engine, _tok, topo, _procs):
        assert [s.connect for s in topo.stages] == [f"tcp://127.0.0.1:{f}" for f in fronts[1:]]
        stamped = [(time.monotonic(), e) for e in engine.generate_blocking(
            GenRequest("relay", tuple(case["prompt_ids"]), max_tokens=n, ignore_eos=True, timeout_s=120))]
    tokens = [e.token_id for _, e in stamped if e.token_id is not None]
    assert first_mismatch(tokens, case["transformers_fp32_ids"]) == n, (tokens, case["transformers_fp32_ids"])
    # each token after the first crossed s0 -> s1, then s1 -> s0 (the ring, through stage 0's relay
    # too) or s1 -> driver -> s0: two one-way delays at least
    times = [t for t, e in stamped if e.token_id is not None]
    assert times[-1] - times[0] >= (n - 1) * 2 * DELAY_S, times
