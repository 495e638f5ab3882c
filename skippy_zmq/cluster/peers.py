"""Worker-to-worker links, measured: each worker answers link probes on a socket of its own, and
measures its would-be neighbours' when the driver asks, so the planner (ops/speed.py) costs a hop
between two workers by their own link instead of guessing it from their links to the driver.

- `ProbeServer`: before its HELLO a worker binds a ROUTER on `listen` (default: every interface,
  a port the system picks), a CURVE server with a keypair made for this run, and reports
  `report["probe"] = {"port", "key"}`. It admits only the client keys the driver names (the join
  tokens' public keys: PROBE carries them; until then its own token's), answers PING {size}
  with PONG of that many zero bytes (at most probe.MAX_PROBE_BYTES) and nothing else; a request
  that breaks a rule is dropped, counted and logged. One thread, every wait bounded by its stop.
- `measure_peers`: for PROBE {peers: [{name, endpoint, key}]} from the driver, a CURVE DEALER to
  each peer (this worker's token keypair as its client key, the peer's probe key as the server's),
  cluster/probe.measure_link over it, every answer within probe.PROBE_TIMEOUT_S; a peer that does
  not answer gets {"error"} instead of numbers. The worker answers PROBED {links}.

The driver (cluster/server.py) asks once the workers it will plan with have measured, waits for
their PROBED up to PROBE_WAIT_S, and plans with what came (split.links_of). A PONG's bytes go
from the peer to the prober: the prober's measurement is the bandwidth peer -> prober.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

import zmq
from loguru import logger

from skippy_zmq.cluster import link
from skippy_zmq.cluster.probe import MAX_PROBE_BYTES, PROBE_TIMEOUT_S, TRANSFER_BYTES, measure_link
from skippy_zmq.protocol.security import CurveAuthenticator, SocketSecurity, start_authenticator
from skippy_zmq.protocol.transport import make_socket

MAX_PEERS = 64             # the most peers one PROBE may name
MAX_PROBE_REQUEST = 4096   # a probe request is a PING header: nothing larger is read
PROBER = "prober"          # the ZAP User-Id of an admitted prober


class ProbeServer:
    """A worker's probe endpoint (module docstring); `close()` when done."""

    def __init__(self, allow: list[bytes], listen: str = "tcp://*:0"):
        self.ctx = zmq.Context()
        public, secret = zmq.curve_keypair()
        self.key = public
        self.auth: CurveAuthenticator = start_authenticator(self.ctx, {k: PROBER for k in allow})
        try:
            self.sock = make_socket(self.ctx, zmq.ROUTER, listen, bind=True, max_message_bytes=MAX_PROBE_REQUEST,
                                    security=SocketSecurity("curve", public, secret, server=True))
        except BaseException:
            self.auth.stop()
            self.ctx.term()
            raise
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.answered = self.dropped = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="probe-server", daemon=True)
        self.thread.start()

    def allow(self, keys: list[bytes]) -> None:
        """Admit these client keys too (the driver's live join tokens, from a PROBE)."""
        self.auth.allowed.update({k: PROBER for k in keys})

    def report(self) -> dict[str, Any]:
        return {"port": self.port, "key": self.key.decode()}

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(200):
                    continue
                identity, *parts = self.sock.recv_multipart(copy=False)
                try:
                    msg = link.parse(parts)
                    if msg.kind != "PING":
                        raise link.LinkError(f"{msg.kind} is not a probe request")
                    size = link.field(msg, "size", int, 0)
                    if size > MAX_PROBE_BYTES:
                        raise link.LinkError(f"PING: size {size} is over the probe cap ({MAX_PROBE_BYTES})")
                except link.LinkError as exc:
                    self.dropped += 1
                    logger.warning("probe: dropped a request: {} ({} dropped so far)", exc, self.dropped)
                    continue
                reply = link.Message("PONG", {"size": size}, bytes(size) if size else None)
                self.answered += 1   # before the PONG leaves: whoever got it sees the count
                # a ROUTER drops (never blocks on) a message to a prober whose queue is full
                self.sock.send_multipart([identity, *link.frames(reply)], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:   # the socket closed under us: close() ran
            if not self._stop.is_set():
                logger.warning("probe: the probe socket failed: {}", exc)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)
        self.sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()


def measure_peer(endpoint: str, server_key: bytes, public: bytes, secret: bytes,
                 transfer_bytes: int = TRANSFER_BYTES, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """probe.measure_link to one peer's probe endpoint over CURVE ({"error"} when it fails)."""
    ctx = zmq.Context()
    sock = None

    def ask(size: int) -> None:
        sock.send_multipart(link.frames(link.Message("PING", {"size": size})))
        if not sock.poll(int(1000 * timeout_s)):
            raise TimeoutError(f"no answer from {endpoint} within {timeout_s:g} s")
        pong = link.parse(sock.recv_multipart(copy=False))
        got = 0 if pong.data is None else len(pong.data)
        if pong.kind != "PONG" or got != size:
            raise link.LinkError(f"{pong.kind} carried {got} bytes, {size} were asked for")

    try:   # an endpoint zmq cannot dial (a bad host name) is this peer's error, not the worker's end
        sock = make_socket(ctx, zmq.DEALER, endpoint, bind=False, max_message_bytes=MAX_PROBE_BYTES + 4096,
                           security=SocketSecurity("curve", public, secret, server=False, server_key=server_key))
        return measure_link(ask, transfer_bytes=transfer_bytes)
    except (TimeoutError, link.LinkError, zmq.ZMQError) as exc:
        return {"error": str(exc)[:300]}
    finally:
        if sock is not None:
            sock.close(linger=0)
        ctx.term()


def peers_of(msg: link.Message) -> list[tuple[str, str, bytes]]:
    """PROBE's peers as (name, endpoint, key), checked (LinkError names what is wrong)."""
    peers = link.field(msg, "peers", list)
    if len(peers) > MAX_PEERS:
        raise link.LinkError(f"PROBE names {len(peers)} peers (cap {MAX_PEERS})")
    out = []
    for p in peers:
        if not (isinstance(p, dict) and all(isinstance(p.get(k), str) for k in ("name", "endpoint", "key"))):
            raise link.LinkError("PROBE: every peer needs a name, an endpoint and a key (strings)")
        if not p["endpoint"].startswith("tcp://") or len(p["endpoint"]) > 200 or len(p["key"]) != 40:
            raise link.LinkError(f"PROBE: peer {p['name'][:64]!r} has a bad endpoint or key")
        out.append((p["name"][:64], p["endpoint"], p["key"].encode()))
    return out


def measure_peers(msg: link.Message, public: bytes, secret: bytes,
                  transfer_bytes: int = TRANSFER_BYTES) -> dict[str, dict[str, Any]]:
    """PROBE -> {peer name: measure_peer result}, one peer after another."""
    found = {}
    for name, endpoint, key in peers_of(msg):
        found[name] = measure_peer(endpoint, key, public, secret, transfer_bytes)
        logger.info("probe: link to {} ({}): {}", name, endpoint, found[name])
    return found


def pair_links(probed: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """{(from, to): {rtt_ms, bytes_per_s}} from each worker's PROBED links (worker -> {peer ->
    result}): a round trip is the pair's both ways; the bandwidth is peer -> prober (PONG's bytes).
    Results with an error or without positive numbers are left out."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for prober, links in probed.items():
        for peer, found in (links or {}).items():
            if not isinstance(found, Mapping) or not all(
                    isinstance(found.get(k), (int, float)) and found[k] > 0 for k in ("rtt_ms", "bytes_per_s")):
                continue
            out[(peer, prober)] = {"rtt_ms": float(found["rtt_ms"]), "bytes_per_s": float(found["bytes_per_s"])}
    return out


# ---------------------------------------------------------------- the driver's side

PROBE_WAIT_S = 60.0   # the driver plans with what came once this long has passed since it asked
MAX_ALLOW_KEYS = 64   # the most client keys one PROBE may admit


def probe_requests(workers: Mapping[str, tuple[str, Any]], allow: list[bytes]) -> dict[str, dict[str, Any]]:
    """PROBE headers, worker name -> {peers, allow}: each worker probes every other one that
    reported a probe endpoint (name -> (address it joined from, its report's "probe")); empty when
    fewer than two did."""
    ends = {}
    for name, (address, probe) in workers.items():
        if isinstance(probe, Mapping) and isinstance(probe.get("port"), int) and 0 < probe["port"] < 65536 \
                and isinstance(probe.get("key"), str) and len(probe["key"]) == 40:
            host = f"[{address}]" if ":" in address else address
            ends[name] = {"name": name, "endpoint": f"tcp://{host}:{probe['port']}", "key": probe["key"]}
    if len(ends) < 2:
        return {}
    keys = [k.decode() for k in allow[:MAX_ALLOW_KEYS]]
    return {name: {"peers": [e for other, e in ends.items() if other != name], "allow": keys} for name in ends}


def allow_keys(msg: link.Message) -> list[bytes]:
    """PROBE's client keys to admit, checked."""
    keys = link.field(msg, "allow", list)
    if len(keys) > MAX_ALLOW_KEYS or not all(isinstance(k, str) and len(k) == 40 for k in keys):
        raise link.LinkError(f"PROBE: allow must be at most {MAX_ALLOW_KEYS} Z85 keys of 40 characters")
    return [k.encode() for k in keys]


def probed_links(msg: link.Message) -> dict[str, dict[str, Any]]:
    """PROBED's links (peer name -> result), checked and trimmed to numbers or an error string."""
    links = link.field(msg, "links", dict)
    if len(links) > MAX_PEERS:
        raise link.LinkError(f"PROBED names {len(links)} peers (cap {MAX_PEERS})")
    out = {}
    for peer, found in links.items():
        if not isinstance(found, dict):
            raise link.LinkError(f"PROBED: the link to {str(peer)[:64]!r} is not an object")
        out[str(peer)[:64]] = {k: found[k] for k in ("rtt_ms", "bytes_per_s", "transfer_bytes")
                               if isinstance(found.get(k), (int, float)) and not isinstance(found[k], bool)} \
            or {"error": str(found.get("error", "no numbers"))[:300]}
    return out
