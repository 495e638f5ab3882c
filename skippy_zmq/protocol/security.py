"""CURVE and ZAP authentication for every ZeroMQ socket of a topology.

`security: curve` is the default: each party ("driver" and every stage id) has
one CURVE keypair (keystore.py says where they live and makes them on first
launch). `security: none` must be asked for, and every process that starts with
it says so at WARNING.

Roles: the binding side of a connection is the CURVE server (a stage's PULL on
`listen`, the driver's ROUTER on `return`); the connecting side is a CURVE
client that must know the server's public key. A server admits only the keys
of the parties that legitimately connect to it (least privilege): a stage's
PULL admits its upstream (the driver for stage 0, else the previous stage; on a
ring, stage 0 the last stage too, for the steps it runs on); the driver's ROUTER
admits every stage. Admission is checked by one ZAP
authenticator per process, which names each admitted peer: the ZAP User-Id of
a connection is its key's party name, and every message received on it carries
that name (`transport.peer_name`), so the driver ties each reply to the stage
whose key sent it, whatever routing identity the peer claims. Server sockets
set ZAP_ENFORCE_DOMAIN, so a process that forgets to start the authenticator
refuses every peer instead of admitting every peer (libzmq's default without a
ZAP handler).

No JAX here, and no sockets other than the authenticator's own.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import zmq
from loguru import logger
from zmq.auth.base import Authenticator
from zmq.utils import z85
from zmq.auth.thread import ThreadAuthenticator

from skippy_zmq.protocol.keystore import DRIVER, Identity, SecurityError, check_private, ensure_keys, generate_keys, keys_dir_of, load_identity, load_public_keys, party_names, private_mkdirs
from skippy_zmq.config.topology import Topology, is_local

ZAP_DOMAIN = "skippy_zmq"  # every CURVE server socket's ZAP domain; the authenticator serves only this one
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
_MAX_WARNED_KEYS = 1024  # distinct rogue keys logged at WARNING; later ones at DEBUG (a rogue can mint keys)


# ------------------------------------------------------------------ socket roles


@dataclass(frozen=True)
class SocketSecurity:
    """CURVE settings of one socket: the binding side is the server; a client must know the server's key."""

    mode: str
    public_key: bytes
    secret_key: bytes = field(repr=False)
    server: bool
    server_key: bytes | None = None  # the peer's public key; clients only

    def __post_init__(self) -> None:
        if self.mode != "curve":
            raise ValueError(f"unknown socket security mode {self.mode!r} (known: curve)")
        if self.server == (self.server_key is not None):
            raise ValueError("a CURVE client needs the server's public key; a CURVE server takes none")


@dataclass(frozen=True)
class PartySecurity:
    """One process's CURVE material: its identity, the servers it connects to, the clients it admits."""

    identity: Identity
    server_keys: Mapping[str, bytes]  # public key of each party this one connects to, by name
    allowed: tuple[bytes, ...]        # public keys its server sockets admit
    admitted: tuple[str, ...] = ()    # their party names, in the same order (the ZAP User-Id of each)

    def server(self) -> SocketSecurity:
        return SocketSecurity("curve", self.identity.public, self.identity.secret, server=True)

    def client(self, peer: str) -> SocketSecurity:
        if peer not in self.server_keys:
            raise SecurityError(f"{self.identity.name} has no public key for {peer!r} "
                                f"(it connects to: {', '.join(self.server_keys) or 'nobody'})")
        return SocketSecurity("curve", self.identity.public, self.identity.secret, server=False,
                              server_key=self.server_keys[peer])

    def start_authenticator(self, ctx: zmq.Context) -> CurveAuthenticator:
        return start_authenticator(ctx, dict(zip(self.allowed, self.admitted or self.allowed)))


def security_for(topology: Topology, role: str) -> PartySecurity | None:
    """The CURVE material of `role` ("driver" or a stage id), or None when security is "none"
    (said at WARNING: every process of such a pipeline says it at every start).

    Loads only what the role needs: its own secret, the public keys of the
    servers it connects to, and of the clients it admits. A generated key
    folder (no keys_dir) and its secret are checked to be this user's and
    private first.
    """
    if topology.security == "none":
        warn_unauthenticated(topology, role)
        return None
    party_names(topology)  # every name must be a safe key-file name
    ids = [s.id for s in topology.stages]
    if role == DRIVER:
        connects, admits = [ids[0]], ids
    else:
        i = topology.index(role)
        connects = [DRIVER, *ids[i + 1:i + 2]]
        admits = [DRIVER if i == 0 else ids[i - 1]]
        if topology.ring and i == 0:   # the ring (stage/run_on.py): the last stage sends steps to the first
            admits.append(ids[-1])
        elif topology.ring and i == len(ids) - 1:
            connects.append(ids[0])
    keys_dir = keys_dir_of(topology)
    generated = topology.keys_dir is None
    if not (keys_dir / f"{role}.key_secret").exists() and _all_local(topology):
        ensure_keys(topology)   # started by hand on a one-machine topology: make them as a launcher would
    if generated and keys_dir.exists():
        check_private(keys_dir, "the key folder")
    identity = load_identity(keys_dir, role, strict=generated)  # first: a missing secret is the likelier mistake
    publics = load_public_keys(keys_dir, dict.fromkeys([*connects, *admits]))
    return PartySecurity(identity=identity,
                         server_keys={name: publics[name] for name in connects},
                         allowed=tuple(publics[name] for name in admits), admitted=tuple(admits))


def _all_local(topology: Topology) -> bool:
    """Every stage runs on this machine: keys made here are the ones every party reads."""
    return all(is_local(s.host) for s in topology.stages)


def warn_unauthenticated(topology: Topology, role: str) -> None:
    """The loud line a `security: none` process logs as it starts."""
    logger.warning("SECURITY: {} runs {} with `security: none`: its ZeroMQ links are NOT authenticated; any "
                   "process that can reach {} can forge stage replies, inject work and change other users' "
                   "output. Remove `security: none` from the topology (CURVE is the default; keys are made on "
                   "first launch).", role, topology.source,
                   ", ".join([topology.driver.return_endpoint, *(s.listen for s in topology.stages)]))


# ------------------------------------------------------------------ ZAP


class _ReleaseEndpointOnStop(Authenticator):
    """Unbind the ZAP endpoint before closing its socket: unbinding inproc is
    synchronous, closing is not, so a process can stop one authenticator and
    start the next at once (a restarted driver engine, tests)."""

    def stop(self) -> None:
        if self.zap_socket is not None and not self.zap_socket.closed:
            try:
                self.zap_socket.unbind(_ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass  # never bound: start() failed
        super().stop()


class CurveAuthenticator(ThreadAuthenticator, _ReleaseEndpointOnStop):
    """A ZAP handler (in a thread) that admits only `allowed` CURVE public keys on ZAP_DOMAIN.

    It is its own credentials provider (`callback`); rejections are logged
    with the peer's address and counted, so tests can wait for one. An
    admitted connection's User-Id is its key's party name (`allowed` maps
    Z85 public key -> name), which every message received on it carries.
    """

    def __init__(self, ctx: zmq.Context, allowed: Mapping[bytes, str]):
        super().__init__(ctx)
        self.allowed = dict(allowed)
        self.rejected = 0
        self._rejections = threading.Condition()
        self._peer = "?"
        self._warned: set[bytes] = set()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # ZAP request (RFC 27): version, request id, domain, address, identity, mechanism, credentials.
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.allowed[z85.encode(client_public_key)]   # called only for an admitted key

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        first = key not in self._warned and len(self._warned) < _MAX_WARNED_KEYS
        if first:
            self._warned.add(key)
        log = logger.warning if first else logger.debug
        log("rejected CURVE peer {} with unknown public key {}", self._peer, key.decode(errors="replace"))
        self.count_rejection()
        return False

    def count_rejection(self) -> None:
        with self._rejections:
            self.rejected += 1
            self._rejections.notify_all()

    def wait_rejected(self, count: int, timeout: float) -> bool:
        """Block until at least `count` peers have been rejected, or `timeout` seconds pass."""
        with self._rejections:
            return self._rejections.wait_for(lambda: self.rejected >= count, timeout)


def start_authenticator(ctx: zmq.Context, allowed: Mapping[bytes, str] | list[bytes],
                        make: Callable[[zmq.Context, dict[bytes, str]], CurveAuthenticator] = CurveAuthenticator,
                        ) -> CurveAuthenticator:
    """Start the context's ZAP handler; do it before any CURVE server socket binds. `stop()` it on close.

    `allowed`: Z85 public key -> the party name that becomes the connection's
    User-Id (a plain list of keys names each peer by its key). `make`: the
    authenticator's class (a subclass with rules of its own, e.g. expiring keys)."""
    if not allowed:
        raise SecurityError("an authenticator that admits no key would refuse every peer")
    names = dict(allowed) if isinstance(allowed, Mapping) else {key: key.decode() for key in allowed}
    auth = make(ctx, names)
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=auth)
    try:
        auth.start()
    except zmq.ZMQError as exc:
        auth.stop()
        if exc.errno == zmq.EADDRINUSE:
            raise SecurityError("this zmq context already has a ZAP authenticator (one per process)") from exc
        raise
    return auth


# ------------------------------------------------------------------ public binds


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard, an interface name or a host name: assume reachable


def warn_public_binds(topology: Topology) -> list[str]:
    """With security "none", warn about every non-loopback bind address; return the warnings."""
    if topology.security != "none":
        return []
    d = topology.driver
    binds = [(d.return_endpoint, "forge stage replies"),
             *((s.listen, "inject activations") for s in topology.stages)]
    warnings = []
    for endpoint, harm in binds:
        m = re.match(r"^tcp://(.+):\d+$", endpoint)
        if m and not _is_loopback(m[1]):
            warnings.append(f"binding {endpoint} without CURVE: anyone who can reach it can {harm}")
    if not _is_loopback(d.http_host):
        warnings.append(f"binding http://{d.http} with security: none: require --api-key for the API "
                        "and set security: curve for the pipeline")
    for text in warnings:
        logger.warning("{}", text)
    return warnings


# ------------------------------------------------------------------ CLI


def cmd_keys(args: argparse.Namespace) -> int:
    """`skippy-zmq keys --topology T [--out DIR] [--force]`."""
    from skippy_zmq.config.topology_yaml import load_topology

    topology = load_topology(args.topology)
    out = args.out or keys_dir_of(topology)
    try:
        if args.out is None and topology.keys_dir is None:   # the generated folder launches would use
            private_mkdirs(keys_dir_of(topology))
        paths = generate_keys(topology, out, force=args.force)
    except (FileExistsError, SecurityError) as exc:
        logger.error("{}", exc)
        return 1
    for path in paths:
        print(path)
    logger.info("wrote CURVE keys for {} parties to {}: copy every *.key to every host, "
                "each NAME.key_secret only to NAME's host", len(paths) // 2, out)
    return 0


def add_keys_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `keys` subcommand."""
    p = subparsers.add_parser("keys", help="write CURVE keypairs for the driver and every stage")
    p.add_argument("--topology", required=True)
    p.add_argument("--out", default=None, help="key directory (default: the topology's keys_dir, "
                   "else its generated folder under ~/.local/state/skippy_zmq/keys)")
    p.add_argument("--force", action="store_true", help="replace existing keys")
    p.set_defaults(func=cmd_keys)
    return p
