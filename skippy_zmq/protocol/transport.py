"""ZeroMQ plumbing: the process context, the one socket factory, and the
chain (PUSH/PULL) and return (DEALER -> ROUTER) sockets of stages and driver.

Only this module creates sockets, so socket policy (HWM, linger, identity,
message size limits, CURVE keys) lives in one place. It never imports JAX;
messages are encoded by `wire` and sent zero-copy.

With a `PartySecurity` (see `security`), every socket is CURVE-encrypted: the
binding side is the CURVE server, the connecting side a client that knows the
server's public key, and the socket set that owns a server socket starts the
process's ZAP authenticator before binding and stops it on close. The
authenticator names each admitted connection by its key's party, and
`peer_name` reads that name off any message received on it.

A stage's DEALERs claim a routing identity that starts with the stage id
(`stage_of`). With CURVE the identity also carries 64 random bits
(`dealer_identity`): the driver's ROUTER hands an identity over to whoever
claims it last (so a restarted stage is never locked out), and a peer that
cannot guess an identity cannot take another stage's route.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

from skippy_zmq.protocol import wire
from skippy_zmq.protocol.security import DRIVER, ZAP_DOMAIN, CurveAuthenticator, PartySecurity, SocketSecurity


# A stage heartbeats on a DEALER of its own whose identity is "<stage id>[#nonce]/hb".
HEARTBEAT_SUFFIX = "/hb"
ROUTE_NONCE = "#"   # a stage id never holds one (keystore.party_names)

# CURVE boxes every frame (8-byte nonce, 16-byte MAC, the MESSAGE command name
# and flags), and libzmq checks MAXMSGSIZE against the boxed frame.
CURVE_FRAME_OVERHEAD = 33


def context() -> zmq.Context:
    """The process-wide context (pyzmq makes a fresh one after fork)."""
    return zmq.Context.instance()


def context_for(security: PartySecurity | None) -> zmq.Context:
    """The context for a driver's sockets: the process's, or with CURVE one of its own (term it
    after closing them): a ZAP handler serves one context, and one process may run several secured
    drivers (tests, benchmarks)."""
    return context() if security is None else zmq.Context()


def make_socket(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    hwm: int = 1000,
    linger_ms: int = 0,
    identity: bytes | None = None,
    max_message_bytes: int = -1,
    security: SocketSecurity | None = None,
    immediate: bool = False,
) -> zmq.Socket:
    """Create, configure and bind or connect a socket.

    Options are set before bind/connect because libzmq applies HWM, identity
    and MAXMSGSIZE per connection when it is made. MAXMSGSIZE limits each
    inbound *frame*: a peer that sends a bigger one is disconnected and the
    message is dropped, so a stage never allocates for it; `wire.decode`
    checks the whole message against its own limit. Bind endpoints may use a
    wildcard port ("tcp://127.0.0.1:*"); read the real one with `bound_endpoint`.
    With `security`, the socket is a CURVE server if it binds, else a client.
    `immediate`: queue messages only on completed connections (a send finds
    no peer rather than waiting for one that may never admit it).
    """
    if security is not None and security.server != bind:
        raise ValueError(f"{endpoint}: the binding side must be the CURVE server and the connecting side a client")
    if security is not None and max_message_bytes > 0:
        max_message_bytes += CURVE_FRAME_OVERHEAD
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if immediate:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        _apply_security(sock, security)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _apply_security(sock: zmq.Socket, security: SocketSecurity | None) -> None:
    """Set CURVE keys; libzmq reads them when a connection's handshake starts.

    A server also joins ZAP_DOMAIN with ZAP_ENFORCE_DOMAIN set: without a ZAP
    handler libzmq would admit any client that knows the server's public key;
    with it, a process that forgot its authenticator admits nobody.
    """
    if security is None:
        return
    sock.curve_publickey = security.public_key
    sock.curve_secretkey = security.secret_key
    if security.server:
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    else:
        sock.curve_serverkey = security.server_key


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint a socket actually bound to (resolves a wildcard port)."""
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


# ---------------------------------------------------------------- messages
#
# copy=False hands libzmq the encoded buffers directly; the caller must not
# mutate arrays in a message until the send completes (pyzmq copies frames
# under zmq.COPY_THRESHOLD anyway, so this only matters for activations).


def send_message(sock: zmq.Socket, msg: wire.Message, dtype: wire.WireDType | None = None, flags: int = 0) -> None:
    """Send one message. `dtype` defaults to `msg.wire_dtype` (f32 unless set)."""
    sock.send_multipart(wire.encode(msg, dtype), flags=flags, copy=False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Receive one message's frames without copying; decode with `wire.decode`."""
    return sock.recv_multipart(flags=flags, copy=False)


def send_routed(
    sock: zmq.Socket, identity: bytes, msg: wire.Message, dtype: wire.WireDType | None = None, flags: int = 0
) -> None:
    """Send through a ROUTER to the peer whose identity is `identity`."""
    sock.send_multipart([identity, *wire.encode(msg, dtype)], flags=flags, copy=False)


def recv_routed(sock: zmq.Socket, flags: int = 0) -> tuple[bytes, list[zmq.Frame]]:
    """Receive on a ROUTER: the sending peer's identity and the message frames."""
    first, *frames = sock.recv_multipart(flags=flags, copy=False)
    return first.bytes, frames


def peer_name(frames: list[zmq.Frame]) -> str | None:
    """The party whose CURVE key sent these frames (the ZAP User-Id the authenticator gave its
    connection), or None on a link without one (security "none", or no frame at all)."""
    try:
        return frames[0].get("User-Id") if frames else None
    except zmq.ZMQError:   # no such property: an unauthenticated connection
        return None


def dealer_identity(stage_id: str, secured: bool, heartbeat: bool = False) -> bytes:
    """The routing identity of a stage's DEALER: its id, with a random nonce when `secured`."""
    nonce = f"{ROUTE_NONCE}{os.urandom(8).hex()}" if secured else ""
    return f"{stage_id}{nonce}{HEARTBEAT_SUFFIX if heartbeat else ''}".encode()


def stage_of(identity: bytes) -> str:
    """The stage a DEALER's routing identity claims to be (to be checked against `peer_name`)."""
    return identity.decode(errors="replace").removesuffix(HEARTBEAT_SUFFIX).partition(ROUTE_NONCE)[0]


# ---------------------------------------------------------------- socket sets


def _server(security: PartySecurity | None) -> SocketSecurity | None:
    return None if security is None else security.server()


def _client(security: PartySecurity | None, peer: str | None, what: str) -> SocketSecurity | None:
    if security is None:
        return None
    if peer is None:
        raise ValueError(f"with CURVE, {what} is needed to look up the peer's public key")
    return security.client(peer)


def _close(*socks: zmq.Socket | None, auth: CurveAuthenticator | None) -> None:
    for sock in socks:
        if sock is not None:
            sock.close(linger=0)
    if auth is not None:
        auth.stop()


@dataclass
class StageSockets:
    """A stage's sockets: PULL work in, PUSH activations on, DEALER replies home."""

    pull: zmq.Socket
    push: zmq.Socket | None  # None on the final stage
    dealer: zmq.Socket
    auth: CurveAuthenticator | None = None  # the process's ZAP handler when CURVE is on
    ring: zmq.Socket | None = None  # the last stage of a ring: PUSH to the first stage's PULL

    def close(self) -> None:
        _close(self.pull, self.push, self.dealer, self.ring, auth=self.auth)


def open_stage_sockets(
    ctx: zmq.Context,
    listen: str,
    next_listen: str | None,
    return_endpoint: str,
    stage_id: str,
    hwm: int = 1000,
    max_message_bytes: int = -1,
    security: PartySecurity | None = None,
    next_stage_id: str | None = None,
    ring: tuple[str, str] | None = None,
) -> StageSockets:
    """Bind `listen`, connect to the next stage (if any) and to the driver.

    The DEALER identity starts with the stage id (`dealer_identity`); with
    CURVE the driver believes it only when the key that sent a message is that
    stage's (`peer_name`). With `security` the authenticator starts
    first, PULL is a CURVE server, PUSH a client of `next_stage_id` and the
    DEALER a client of the driver. `ring` (the last stage of a ring: the first
    stage's endpoint and id) adds a PUSH to the first stage, queueing only on a
    completed connection (stage/run_on.py).
    """
    push_security = _client(security, next_stage_id, "next_stage_id") if next_listen is not None else None
    ring_security = _client(security, ring[1], "the first stage's id") if ring is not None else None
    auth = security.start_authenticator(ctx) if security is not None else None
    pull = push = dealer = ring_push = None
    try:
        pull = make_socket(ctx, zmq.PULL, listen, bind=True, hwm=hwm, max_message_bytes=max_message_bytes,
                           security=_server(security))
        if next_listen is not None:
            push = make_socket(ctx, zmq.PUSH, next_listen, bind=False, hwm=hwm, security=push_security)
        dealer = make_socket(ctx, zmq.DEALER, return_endpoint, bind=False, hwm=hwm,
                             identity=dealer_identity(stage_id, security is not None),
                             max_message_bytes=max_message_bytes, security=_client(security, DRIVER, "the driver"))
        if ring is not None:
            ring_push = make_socket(ctx, zmq.PUSH, ring[0], bind=False, hwm=hwm, security=ring_security,
                                    immediate=True)
    except BaseException:
        _close(pull, push, dealer, ring_push, auth=auth)
        raise
    return StageSockets(pull=pull, push=push, dealer=dealer, auth=auth, ring=ring_push)


def open_heartbeat_socket(
    ctx: zmq.Context, return_endpoint: str, stage_id: str, security: PartySecurity | None = None, hwm: int = 1000,
) -> zmq.Socket:
    """A stage's heartbeat DEALER (identity "<stage id>[#nonce]/hb"); a CURVE client of the driver when secured."""
    return make_socket(ctx, zmq.DEALER, return_endpoint, bind=False, hwm=hwm,
                       identity=dealer_identity(stage_id, security is not None, heartbeat=True),
                       security=_client(security, DRIVER, "the driver"))


@dataclass
class DriverSockets:
    """The driver's sockets: PUSH work to stage 0, ROUTER for every stage's replies."""

    push: zmq.Socket
    router: zmq.Socket
    auth: CurveAuthenticator | None = None  # the process's ZAP handler when CURVE is on

    def close(self) -> None:
        _close(self.push, self.router, auth=self.auth)


def open_driver_sockets(
    ctx: zmq.Context,
    first_listen: str,
    return_endpoint: str,
    hwm: int = 1000,
    max_message_bytes: int = -1,
    security: PartySecurity | None = None,
    first_stage_id: str | None = None,
) -> DriverSockets:
    """Bind the return ROUTER first (stages connect to it), then connect to stage 0.

    With `security` the authenticator starts first, the ROUTER is a CURVE
    server and the PUSH a client of `first_stage_id`.
    """
    push_security = _client(security, first_stage_id, "first_stage_id")
    auth = security.start_authenticator(ctx) if security is not None else None
    router = None
    try:
        router = make_socket(ctx, zmq.ROUTER, return_endpoint, bind=True, hwm=hwm,
                             max_message_bytes=max_message_bytes, security=_server(security))
        # A replacement stage reuses its predecessor's identity; it must win even if the old
        # connection has not been torn down yet, or its READY would be dropped.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        push = make_socket(ctx, zmq.PUSH, first_listen, bind=False, hwm=hwm, security=push_security)
    except BaseException:
        _close(router, auth=auth)
        raise
    return DriverSockets(push=push, router=router, auth=auth)
