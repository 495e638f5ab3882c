"""CURVE keys and ZAP authentication for every ZeroMQ socket of a topology.

Each party ("driver" and every stage id) has one CURVE keypair, written by
`skippy-zmq keys` as NAME.key (public) and NAME.key_secret (secret, mode 0600).
Copy every NAME.key to every host and NAME.key_secret only to NAME's host.

Roles: the binding side of a connection is the CURVE server (a stage's PULL on
`listen`, the driver's ROUTER on `return`); the connecting side is a CURVE
client that must know the server's public key. A server admits only the keys
of the parties that legitimately connect to it (least privilege): a stage's
PULL admits its upstream (the driver for stage 0, else the previous stage); the
driver's ROUTER admits every stage. Admission is checked by one ZAP
authenticator per process. Server sockets set ZAP_ENFORCE_DOMAIN, so a process
that forgets to start the authenticator refuses every peer instead of
admitting every peer (libzmq's default without a ZAP handler).

No JAX here, and no sockets other than the authenticator's own.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from loguru import logger
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator

from skippy_zmq.topology import Topology

DRIVER = "driver"
ZAP_DOMAIN = "skippy_zmq"  # every CURVE server socket's ZAP domain; the authenticator serves only this one
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MAX_WARNED_KEYS = 1024  # distinct rogue keys logged at WARNING; later ones at DEBUG (a rogue can mint keys)


class SecurityError(RuntimeError):
    """Keys are missing, unreadable or inconsistent with the topology."""


# ------------------------------------------------------------------ keys


@dataclass(frozen=True)
class Identity:
    """This process's CURVE keypair (Z85 bytes, as libzmq's socket options take them)."""

    name: str
    public: bytes
    secret: bytes = field(repr=False)


def party_names(topology: Topology) -> list[str]:
    """"driver" and every stage id, checked to be safe file names."""
    names = [DRIVER, *(s.id for s in topology.stages)]
    if DRIVER in names[1:]:
        raise SecurityError(f"{topology.source}: a stage may not be called {DRIVER!r}: that is the driver's key")
    for name in names:
        if not _NAME.fullmatch(name):
            raise SecurityError(f"{topology.source}: stage id {name!r} cannot name a key file "
                                "(use letters, digits, '_', '.', '-')")
    return names


def generate_keys(topology: Topology, out_dir: str | Path, force: bool = False) -> list[Path]:
    """Write NAME.key and NAME.key_secret for the driver and every stage; return the paths.

    Refuses (FileExistsError, nothing written) if any of those files exists,
    unless `force`: replacing keys means every host needs the new public keys.
    Each pair is written inside a private (0700) temporary directory, the
    secret chmod'ed to 0600, then moved into place, so a secret is never
    readable by others even for a moment.
    """
    names = party_names(topology)
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = [p for n in names for p in (out / f"{n}.key", out / f"{n}.key_secret") if p.exists()]
    if existing and not force:
        raise FileExistsError(f"refusing to overwrite existing keys ({', '.join(map(str, existing))}); "
                              "pass --force to replace them (every host then needs the new public keys)")
    written: list[Path] = []
    tmp = Path(tempfile.mkdtemp(prefix=".keys-", dir=out))
    try:
        for name in names:
            public, secret = (Path(p) for p in zmq.auth.create_certificates(tmp, name))
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            for path in (public, secret):
                os.replace(path, out / path.name)
                written.append(out / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def load_identity(keys_dir: str | Path, name: str) -> Identity:
    """Read NAME.key_secret (public and secret key) from `keys_dir`."""
    path = Path(keys_dir) / f"{name}.key_secret"
    public, secret = _load_certificate(path)
    if not secret:
        raise SecurityError(f"{path}: holds no secret key (is it a public certificate?)")
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        logger.warning("{} is readable by other users; chmod 600 it", path)
    return Identity(name, public, secret)


def load_public_keys(keys_dir: str | Path, names: Iterable[str]) -> dict[str, bytes]:
    """Public keys by party name, from NAME.key in `keys_dir`."""
    return {name: _load_certificate(Path(keys_dir) / f"{name}.key")[0] for name in names}


def _load_certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{path}: cannot load CURVE certificate ({exc}); "
                            "create keys with `skippy-zmq keys --topology T --out DIR`") from exc


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

    def server(self) -> SocketSecurity:
        return SocketSecurity("curve", self.identity.public, self.identity.secret, server=True)

    def client(self, peer: str) -> SocketSecurity:
        if peer not in self.server_keys:
            raise SecurityError(f"{self.identity.name} has no public key for {peer!r} "
                                f"(it connects to: {', '.join(self.server_keys) or 'nobody'})")
        return SocketSecurity("curve", self.identity.public, self.identity.secret, server=False,
                              server_key=self.server_keys[peer])

    def start_authenticator(self, ctx: zmq.Context) -> CurveAuthenticator:
        return start_authenticator(ctx, list(self.allowed))


def security_for(topology: Topology, role: str) -> PartySecurity | None:
    """The CURVE material of `role` ("driver" or a stage id), or None when security is "none".

    Loads only what the role needs: its own secret, the public keys of the
    servers it connects to, and of the clients it admits.
    """
    if topology.security == "none":
        return None
    if topology.keys_dir is None:
        raise SecurityError(f"{topology.source}: security: curve needs keys_dir (run `skippy-zmq keys`)")
    party_names(topology)  # every name must be a safe key-file name
    ids = [s.id for s in topology.stages]
    if role == DRIVER:
        connects, admits = [ids[0]], ids
    else:
        i = topology.index(role)
        connects = [DRIVER, *ids[i + 1:i + 2]]
        admits = [DRIVER if i == 0 else ids[i - 1]]
    keys_dir = Path(topology.keys_dir)
    identity = load_identity(keys_dir, role)  # first: a missing secret is the likelier mistake
    publics = load_public_keys(keys_dir, dict.fromkeys([*connects, *admits]))
    return PartySecurity(identity=identity,
                         server_keys={name: publics[name] for name in connects},
                         allowed=tuple(publics[name] for name in admits))


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
    with the peer's address and counted, so tests can wait for one.
    """

    def __init__(self, ctx: zmq.Context, allowed: Iterable[bytes]):
        super().__init__(ctx)
        self.allowed = frozenset(allowed)
        self.rejected = 0
        self._rejections = threading.Condition()
        self._peer = "?"
        self._warned: set[bytes] = set()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # ZAP request (RFC 27): version, request id, domain, address, identity, mechanism, credentials.
        self._peer = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        first = key not in self._warned and len(self._warned) < _MAX_WARNED_KEYS
        if first:
            self._warned.add(key)
        log = logger.warning if first else logger.debug
        log("rejected CURVE peer {} with unknown public key {}", self._peer, key.decode(errors="replace"))
        with self._rejections:
            self.rejected += 1
            self._rejections.notify_all()
        return False

    def wait_rejected(self, count: int, timeout: float) -> bool:
        """Block until at least `count` peers have been rejected, or `timeout` seconds pass."""
        with self._rejections:
            return self._rejections.wait_for(lambda: self.rejected >= count, timeout)


def start_authenticator(ctx: zmq.Context, allowed_public_keys: list[bytes]) -> CurveAuthenticator:
    """Start the context's ZAP handler; do it before any CURVE server socket binds. `stop()` it on close."""
    if not allowed_public_keys:
        raise SecurityError("an authenticator that admits no key would refuse every peer")
    auth = CurveAuthenticator(ctx, allowed_public_keys)
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
    from skippy_zmq.topology import load_topology

    topology = load_topology(args.topology)
    out = args.out or topology.keys_dir
    if out is None:
        logger.error("{}: no keys_dir in the topology; pass --out DIR", args.topology)
        return 2
    try:
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
    p.add_argument("--out", default=None, help="key directory (default: the topology's keys_dir)")
    p.add_argument("--force", action="store_true", help="replace existing keys")
    p.set_defaults(func=cmd_keys)
    return p
