"""CURVE keys, ZAP admission and secured socket sets, over real TCP on 127.0.0.1.

Every party gets a zmq context of its own, as separate processes would: the
ZAP authenticator is per context. Nothing sleeps: arrivals are awaited with
bounded polls, rejections with the authenticator's condition variable, and
"nothing got through" is a poll that times out.
"""

from __future__ import annotations

import argparse
import dataclasses
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from loguru import logger

from skippy_zmq.protocol import keystore, security, transport, wire
from skippy_zmq.protocol.security import SecurityError, SocketSecurity
from skippy_zmq.config.topology import Topology, TopologyError
from skippy_zmq.config.topology_yaml import parse_topology
from skippy_zmq.protocol.wire import Kind, Message
from procs import free_endpoint

WAIT_MS = 2000      # bound for what must arrive (returns as soon as it does)
SILENCE_MS = 300    # how long a server listens to prove that nothing arrives
ANY_PORT = "tcp://127.0.0.1:*"




def topology_dict(keys_dir: Path | None, security_mode: str = "curve", host: str = "127.0.0.1") -> dict:
    data = {
        "model": "models/none", "security": security_mode,
        "driver": {"return": f"tcp://{host}:5600", "http": f"{host}:8000"},
        "stages": [{"id": "s0", "layers": [0, 2], "listen": f"tcp://{host}:5601"},
                   {"id": "s1", "layers": [2, 4], "listen": f"tcp://{host}:5602"}],
    }
    if keys_dir is not None:
        data["keys_dir"] = str(keys_dir)
    return data


def activation_message(request_id: int = 7) -> Message:
    act = np.arange(2 * 16, dtype=np.float32).reshape(2, 16)
    return Message(Kind.PREFILL, request_id=request_id, session_id=3, position=0,
                   tokens=np.array([5, 6], np.int32), activation=act)


def received(sock: zmq.Socket, timeout_ms: int = WAIT_MS) -> bool:
    return bool(sock.poll(timeout_ms, zmq.POLLIN))


@pytest.fixture
def topology(tmp_path: Path) -> Topology:
    topo = parse_topology(topology_dict(tmp_path / "keys"))
    security.generate_keys(topo, tmp_path / "keys")
    return topo


@pytest.fixture
def new_context() -> Iterator[Callable[[], zmq.Context]]:
    """A fresh context per party; destroyed (linger 0) after the test."""
    made: list[zmq.Context] = []

    def make() -> zmq.Context:
        made.append(zmq.Context())
        return made[-1]

    yield make
    for ctx in made:
        ctx.destroy(linger=0)


# ------------------------------------------------------------------ keys


def keys_args(topology_path: Path, out: Path, force: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    security.add_keys_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["keys", "--topology", str(topology_path), "--out", str(out), *(["--force"] * force)])


def test_keys_command_writes_certs_refuses_overwrite_and_keeps_secrets_private(tmp_path: Path) -> None:
    import yaml

    topo_path = tmp_path / "topo.yaml"
    topo_path.write_text(yaml.safe_dump(topology_dict(None)))
    out = tmp_path / "keys"
    args = keys_args(topo_path, out)
    assert args.func is security.cmd_keys and args.func(args) == 0

    names = ["driver", "s0", "s1"]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}{ext}" for n in names for ext in (".key", ".key_secret"))
    for name in names:
        assert stat.S_IMODE((out / f"{name}.key_secret").stat().st_mode) == 0o600
        ident = security.load_identity(out, name)
        assert len(ident.public) == 40 and len(ident.secret) == 40 and ident.secret not in repr(ident).encode()
        assert security.load_public_keys(out, [name]) == {name: ident.public}
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    assert args.func(args) == 1  # refused: nothing rewritten
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    forced = keys_args(topo_path, out, force=True)
    assert forced.func(forced) == 0
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in before)


def test_generate_keys_refuses_existing_files_and_unsafe_names(tmp_path: Path) -> None:
    topo = parse_topology(topology_dict(None))
    security.generate_keys(topo, tmp_path)
    with pytest.raises(FileExistsError, match="--force"):
        security.generate_keys(topo, tmp_path)
    bad = topology_dict(None)
    bad["stages"][1]["id"] = "../s1"   # refused before any key is named: the topology checks stage ids
    with pytest.raises(TopologyError, match=r"stages\[1\]\.id: expected a name"):
        parse_topology(bad)
    assert not (tmp_path / "other").exists()
    bad["stages"][1]["id"] = "driver"
    with pytest.raises(SecurityError, match="driver"):
        security.generate_keys(parse_topology(bad), tmp_path / "other")


# ------------------------------------------------------------------ roles


def test_security_for_driver_and_every_stage(topology: Topology) -> None:
    keys = security.load_public_keys(topology.keys_dir, ["driver", "s0", "s1"])
    driver = security.security_for(topology, "driver")
    s0 = security.security_for(topology, "s0")
    s1 = security.security_for(topology, "s1")
    assert driver.identity.public == keys["driver"] and s1.identity.name == "s1"
    # Least privilege: each server admits exactly the parties that connect to it; on a ring (the
    # default: run_on 8) the last stage connects to the first, which admits it (stage/run_on.py).
    assert topology.ring
    assert dict(driver.server_keys) == {"s0": keys["s0"]} and set(driver.allowed) == {keys["s0"], keys["s1"]}
    assert dict(s0.server_keys) == {"driver": keys["driver"], "s1": keys["s1"]}
    assert s0.allowed == (keys["driver"], keys["s1"]) and s0.admitted == ("driver", "s1")
    assert dict(s1.server_keys) == {"driver": keys["driver"], "s0": keys["s0"]} and s1.allowed == (keys["s0"],)
    no_ring = dataclasses.replace(topology, driver=dataclasses.replace(topology.driver, run_on=0))
    assert not no_ring.ring
    assert security.security_for(no_ring, "s0").allowed == (keys["driver"],)
    assert dict(security.security_for(no_ring, "s1").server_keys) == {"driver": keys["driver"]}

    server, client = s0.server(), s0.client("s1")
    assert server.server and server.server_key is None and server.public_key == keys["s0"]
    assert not client.server and client.server_key == keys["s1"]
    with pytest.raises(SecurityError, match="no public key for 'driverx'"):
        s0.client("driverx")


def test_security_for_none_warns_and_missing_keys_say_how_to_make_them(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(keystore.KEYS_HOME_ENV, str(tmp_path / "home"))
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    try:
        assert security.security_for(parse_topology(topology_dict(None, "none")), "s0") is None
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and "s0 runs <dict> with `security: none`" in lines[0] and "NOT authenticated" in lines[0]
    remote = parse_topology(topology_dict(None, host="10.9.9.9"))   # stages elsewhere: keys made here would not be theirs
    with pytest.raises(SecurityError, match=r"home/[0-9a-f]{20}/driver\.key_secret.*skippy-zmq launch"):
        security.security_for(remote, "driver")
    local = parse_topology(topology_dict(None))   # every stage on this machine: started by hand, it makes them
    assert security.security_for(local, "s1").identity.name == "s1"
    assert (keystore.keys_dir_of(local) / "driver.key_secret").is_file()
    with pytest.raises(SecurityError, match=r"empty/s0\.key_secret"):
        security.security_for(parse_topology(topology_dict(tmp_path / "empty", host="10.9.9.9")), "s0")


def test_curve_is_the_default() -> None:
    data = topology_dict(None)
    del data["security"]
    assert parse_topology(data).security == "curve"


# ------------------------------------------------------------------ keys made on first launch


def test_first_launch_makes_private_keys_once_per_topology(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(keystore.KEYS_HOME_ENV, str(tmp_path / "home"))
    topo = parse_topology(topology_dict(None))
    folder = keystore.ensure_keys(topo)
    assert folder == tmp_path / "home" / keystore.topology_digest(topo)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{n}{ext}" for n in ("driver", "s0", "s1") for ext in (".key", ".key_secret"))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert keystore.ensure_keys(topo) == folder and {p.name: p.read_bytes() for p in folder.iterdir()} == before
    tuned = topology_dict(None)
    tuned["driver"]["max_sessions"] = 3   # tuning knobs keep the keys; another endpoint is another pipeline
    assert keystore.ensure_keys(parse_topology(tuned)) == folder
    moved = topology_dict(None)
    moved["stages"][1]["listen"] = "tcp://127.0.0.1:5609"
    assert keystore.ensure_keys(parse_topology(moved)) != folder
    s0 = security.security_for(topo, "s0")
    assert s0.identity.public == security.load_public_keys(folder, ["s0"])["s0"] and s0.admitted == ("driver", "s1")
    assert keystore.ensure_keys(parse_topology(topology_dict(None, "none"))) is None


def test_generated_keys_are_refused_when_others_could_read_or_replace_them(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(keystore.KEYS_HOME_ENV, str(tmp_path / "home"))
    topo = parse_topology(topology_dict(None))
    folder = keystore.ensure_keys(topo)
    folder.chmod(0o755)
    with pytest.raises(SecurityError, match="mode 0755.*chmod 700"):
        security.security_for(topo, "driver")
    with pytest.raises(SecurityError, match="mode 0755"):
        keystore.ensure_keys(topo)
    folder.chmod(0o700)
    (folder / "s1.key_secret").chmod(0o644)
    with pytest.raises(SecurityError, match=r"s1\.key_secret: the secret key has mode 0644"):
        security.security_for(topo, "s1")
    (folder / "s1.key_secret").chmod(0o600)
    real = folder.rename(folder.with_name("elsewhere"))
    folder.symlink_to(real)
    with pytest.raises(SecurityError, match="symbolic link"):
        security.security_for(topo, "s0")
    folder.unlink()
    real.rename(folder)
    (folder / "s0.key").unlink()
    with pytest.raises(SecurityError, match=r"some CURVE keys are missing \(s0\.key\)"):
        keystore.ensure_keys(topo)


def test_keys_command_writes_the_generated_folder_by_default(tmp_path: Path, monkeypatch) -> None:
    import yaml

    monkeypatch.setenv(keystore.KEYS_HOME_ENV, str(tmp_path / "home"))
    topo_path = tmp_path / "topo.yaml"
    topo_path.write_text(yaml.safe_dump(topology_dict(None)))
    parser = argparse.ArgumentParser()
    security.add_keys_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["keys", "--topology", str(topo_path)])
    assert args.func(args) == 0
    folder = keystore.keys_dir_of(parse_topology(topology_dict(None)))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and (folder / "s1.key_secret").is_file()
    assert keystore.ensure_keys(parse_topology(topology_dict(None))) == folder


def test_socket_security_rejects_inconsistent_roles() -> None:
    pub, sec = zmq.curve_keypair()
    with pytest.raises(ValueError):
        SocketSecurity("curve", pub, sec, server=False)
    with pytest.raises(ValueError):
        SocketSecurity("curve", pub, sec, server=True, server_key=pub)
    with pytest.raises(ValueError, match="binding side"):
        transport.make_socket(zmq.Context.instance(), zmq.PULL, ANY_PORT, bind=True,
                              security=SocketSecurity("curve", pub, sec, server=False, server_key=pub))


# ------------------------------------------------------------------ wire traffic and rogues


def test_curve_push_pull_and_dealer_router_deliver(topology: Topology, new_context) -> None:
    driver, s0 = security.security_for(topology, "driver"), security.security_for(topology, "s0")
    server_ctx, client_ctx = new_context(), new_context()
    auth = driver.start_authenticator(server_ctx)
    try:
        router = transport.make_socket(server_ctx, zmq.ROUTER, ANY_PORT, bind=True, security=driver.server())
        pull = transport.make_socket(server_ctx, zmq.PULL, ANY_PORT, bind=True, security=driver.server())
        dealer = transport.make_socket(client_ctx, zmq.DEALER, transport.bound_endpoint(router), bind=False,
                                       identity=b"s0", security=s0.client("driver"))
        push = transport.make_socket(client_ctx, zmq.PUSH, transport.bound_endpoint(pull), bind=False,
                                     security=s0.client("driver"))
        assert router.curve_server and not dealer.curve_server

        transport.send_message(push, activation_message(1))
        assert received(pull)
        got = wire.decode(transport.recv_frames(pull))
        assert got.request_id == 1 and got.activation.tolist() == activation_message().activation.tolist()

        transport.send_message(dealer, Message.predicted_tokens(2, [3], [44]))
        assert received(router)
        identity, frames = transport.recv_routed(router)
        assert identity == b"s0" and wire.decode(frames).tokens.tolist() == [44]
        assert transport.peer_name(frames) == "s0"   # the ZAP User-Id: the party whose key sent it
        transport.send_routed(router, b"s0", Message(Kind.HEARTBEAT))
        assert received(dealer) and wire.decode(transport.recv_frames(dealer)).kind is Kind.HEARTBEAT
        assert auth.rejected == 0
    finally:
        auth.stop()


ROGUES = ["unknown-keypair", "plain-tcp", "wrong-server-key"]


def rogue_security(kind: str, server_public: bytes, valid: SocketSecurity) -> SocketSecurity | None:
    """How each rogue client is configured; the server's public key is no secret, so rogues know it."""
    if kind == "plain-tcp":
        return None
    if kind == "unknown-keypair":
        pub, sec = zmq.curve_keypair()
        return SocketSecurity("curve", pub, sec, server=False, server_key=server_public)
    impostor_server, _ = zmq.curve_keypair()  # an admitted keypair, but the wrong server key
    return SocketSecurity("curve", valid.public_key, valid.secret_key, server=False, server_key=impostor_server)


@pytest.mark.parametrize("kind", [zmq.PULL, zmq.ROUTER], ids=["push-pull", "dealer-router"])
@pytest.mark.parametrize("rogue", ROGUES)
def test_rogue_clients_get_nothing_through(topology: Topology, new_context, rogue: str, kind: int) -> None:
    s0, s1 = security.security_for(topology, "s0"), security.security_for(topology, "s1")  # s1 admits only s0
    server_ctx, rogue_ctx, client_ctx = new_context(), new_context(), new_context()
    auth = s1.start_authenticator(server_ctx)
    try:
        server = transport.make_socket(server_ctx, kind, ANY_PORT, bind=True, security=s1.server())
        endpoint, client_kind = transport.bound_endpoint(server), zmq.PUSH if kind == zmq.PULL else zmq.DEALER
        valid = s0.client("s1")
        attacker = transport.make_socket(rogue_ctx, client_kind, endpoint, bind=False,
                                         security=rogue_security(rogue, s1.identity.public, valid))
        transport.send_message(attacker, activation_message(666))
        if rogue == "unknown-keypair":
            assert auth.wait_rejected(1, WAIT_MS / 1000)  # the handshake reached ZAP and was refused
        assert not received(server, SILENCE_MS)

        client = transport.make_socket(client_ctx, client_kind, endpoint, bind=False, security=valid)
        transport.send_message(client, activation_message(1))
        assert received(server)
        frames = transport.recv_routed(server)[1] if kind == zmq.ROUTER else transport.recv_frames(server)
        assert wire.decode(frames).request_id == 1
        assert not received(server, 0)  # the rogue's message never turns up later
    finally:
        auth.stop()


def test_curve_server_without_authenticator_fails_closed(topology: Topology, new_context) -> None:
    """Forgetting the authenticator must refuse even valid peers (libzmq's default would admit anyone)."""
    s0, s1 = security.security_for(topology, "s0"), security.security_for(topology, "s1")
    pull = transport.make_socket(new_context(), zmq.PULL, ANY_PORT, bind=True, security=s1.server())
    push = transport.make_socket(new_context(), zmq.PUSH, transport.bound_endpoint(pull), bind=False,
                                 security=s0.client("s1"))
    transport.send_message(push, activation_message())
    assert not received(pull, SILENCE_MS)


def test_one_authenticator_per_context_and_a_restart_at_once(topology: Topology, new_context) -> None:
    ctx = new_context()
    auth = security.security_for(topology, "driver").start_authenticator(ctx)
    try:
        with pytest.raises(SecurityError, match="already has a ZAP authenticator"):
            security.security_for(topology, "s0").start_authenticator(ctx)
    finally:
        auth.stop()
    # A closed socket set frees the ZAP endpoint synchronously: the next one opens (and admits) at once.
    sec = {role: security.security_for(topology, role) for role in ("driver", "s0")}
    for request_id in range(3):
        listen, ret = free_endpoint(), free_endpoint()
        driver = transport.open_driver_sockets(ctx, listen, ret, security=sec["driver"], first_stage_id="s0")
        stage = transport.open_stage_sockets(new_context(), listen, None, ret, "s0", security=sec["s0"])
        try:
            transport.send_message(stage.dealer, activation_message(request_id))
            assert received(driver.router)
            assert wire.decode(transport.recv_routed(driver.router)[1]).request_id == request_id
        finally:
            stage.close()
            driver.close()


# ------------------------------------------------------------------ secured socket sets


def test_secured_pipeline_sockets_carry_every_hop(topology: Topology, new_context) -> None:
    """driver -> s0 -> s1 -> driver, plus s0's heartbeat, each party in its own context."""
    listen0, listen1, ret = free_endpoint(), free_endpoint(), free_endpoint()
    sec = {role: security.security_for(topology, role) for role in ("driver", "s0", "s1")}
    s1 = transport.open_stage_sockets(new_context(), listen1, None, ret, "s1", security=sec["s1"],
                                      ring=(listen0, "s0"))
    s0_ctx = new_context()
    s0 = transport.open_stage_sockets(s0_ctx, listen0, listen1, ret, "s0", security=sec["s0"], next_stage_id="s1")
    driver = transport.open_driver_sockets(new_context(), listen0, ret, security=sec["driver"], first_stage_id="s0")
    beats = transport.open_heartbeat_socket(s0_ctx, ret, "s0", security=sec["s0"])
    try:
        assert s0.pull.curve_server and not s0.push.curve_server
        assert {s.getsockopt(zmq.MECHANISM) for s in (s0.pull, s0.push, s0.dealer, beats)} == {zmq.CURVE}
        transport.send_message(driver.push, activation_message(5))
        assert received(s0.pull)
        transport.send_message(s0.push, wire.decode(transport.recv_frames(s0.pull)))
        assert received(s1.pull)
        assert wire.decode(transport.recv_frames(s1.pull)).request_id == 5

        transport.send_message(s1.dealer, Message.predicted_tokens(5, [3], [9]))
        transport.send_message(beats, Message.heartbeat("s0", 1, {"state": "serving"}))
        senders = set()
        for _ in range(2):
            assert received(driver.router)
            identity, frames = transport.recv_routed(driver.router)
            senders.add((transport.stage_of(identity), identity.endswith(b"/hb"), transport.peer_name(frames)))
        assert senders == {("s1", False, "s1"), ("s0", True, "s0")}   # identities carry a nonce; keys name them
        # the ring: the last stage's steps reach the first stage under the last stage's key
        assert s1.ring.poll(WAIT_MS, zmq.POLLOUT) and s1.ring.getsockopt(zmq.MECHANISM) == zmq.CURVE
        transport.send_message(s1.ring, Message.predicted_tokens(6, [3], [9]), flags=zmq.NOBLOCK)
        assert received(s0.pull) and transport.peer_name(transport.recv_frames(s0.pull)) == "s1"
        assert (driver.auth.rejected, s0.auth.rejected, s1.auth.rejected) == (0, 0, 0)
    finally:
        beats.close(linger=0)
        for sockets in (driver, s0, s1):
            sockets.close()
    assert not (driver.auth.is_alive() or s0.auth.is_alive() or s1.auth.is_alive())


def test_a_first_stage_that_does_not_admit_the_ring_leaves_its_push_without_a_connection(
        topology: Topology, new_context) -> None:
    """A first stage started without the ring (run_on 0; or kept by a re-cut that made another stage
    last) refuses the last stage's key, and the ring's PUSH (immediate) never becomes writable: the
    last stage then asks the driver for each step (StageLoop.ring_first)."""
    listen0, ret = free_endpoint(), free_endpoint()
    no_ring = dataclasses.replace(topology, driver=dataclasses.replace(topology.driver, run_on=0))
    s0 = transport.open_stage_sockets(new_context(), listen0, None, ret, "s0",
                                      security=security.security_for(no_ring, "s0"))
    s1 = transport.open_stage_sockets(new_context(), free_endpoint(), None, ret, "s1",
                                      security=security.security_for(topology, "s1"), ring=(listen0, "s0"))
    try:
        assert s0.auth.wait_rejected(1, WAIT_MS / 1000)
        assert not s1.ring.poll(SILENCE_MS, zmq.POLLOUT)
        with pytest.raises(zmq.Again):
            transport.send_message(s1.ring, Message.predicted_tokens(6, [3], [9]), flags=zmq.NOBLOCK)
    finally:
        s1.close()
        s0.close()


def test_secured_stage_needs_next_stage_id(topology: Topology, new_context) -> None:
    with pytest.raises(ValueError, match="next_stage_id"):
        transport.open_stage_sockets(new_context(), ANY_PORT, free_endpoint(), free_endpoint(), "s0",
                                     security=security.security_for(topology, "s0"))


def test_curve_frame_at_the_size_limit_still_arrives(topology: Topology, new_context) -> None:
    """MAXMSGSIZE counts CURVE's per-frame overhead; the factory adds it back."""
    s0, s1 = security.security_for(topology, "s0"), security.security_for(topology, "s1")
    server_ctx = new_context()
    auth = s1.start_authenticator(server_ctx)
    try:
        pull = transport.make_socket(server_ctx, zmq.PULL, ANY_PORT, bind=True, max_message_bytes=4096,
                                     security=s1.server())
        push = transport.make_socket(new_context(), zmq.PUSH, transport.bound_endpoint(pull), bind=False,
                                     security=s0.client("s1"))
        push.send_multipart([b"x" * 4096, b"y"])
        assert received(pull) and [len(f) for f in pull.recv_multipart()] == [4096, 1]
        push.send_multipart([b"x" * 4097])
        assert not received(pull, SILENCE_MS)
    finally:
        auth.stop()


# ------------------------------------------------------------------ public binds


@pytest.mark.parametrize(("host", "mode", "expected"), [
    ("0.0.0.0", "none", 4), ("127.0.0.1", "none", 0), ("localhost", "none", 0), ("0.0.0.0", "curve", 0),
])
def test_warn_public_binds(tmp_path: Path, host: str, mode: str, expected: int) -> None:
    warnings = security.warn_public_binds(parse_topology(topology_dict(tmp_path, mode, host)))
    assert len(warnings) == expected
    if expected:
        assert ("binding tcp://0.0.0.0:5601 without CURVE: anyone who can reach it can inject activations"
                in warnings)
        assert any("http://0.0.0.0:8000" in w for w in warnings)
