"""ZeroMQ plumbing: the process context, the one socket factory, and the
chain (PUSH/PULL) and return (DEALER -> ROUTER) sockets of stages and driver.

Only this module creates sockets, so socket policy (HWM, linger, identity,
message size limits, and later CURVE keys) lives in one place. It never
imports JAX; messages are encoded by `wire` and sent zero-copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from skippy_zmq import wire


# A stage heartbeats on a DEALER of its own whose identity is "<stage id>/hb".
HEARTBEAT_SUFFIX = "/hb"


def context() -> zmq.Context:
    """The process-wide context (pyzmq makes a fresh one after fork)."""
    return zmq.Context.instance()


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
) -> zmq.Socket:
    """Create, configure and bind or connect a socket.

    Options are set before bind/connect because libzmq applies HWM, identity
    and MAXMSGSIZE per connection when it is made. MAXMSGSIZE limits each
    inbound *frame*: a peer that sends a bigger one is disconnected and the
    message is dropped, so a stage never allocates for it; `wire.decode`
    checks the whole message against its own limit. Bind endpoints may use a
    wildcard port ("tcp://127.0.0.1:*"); read the real one with `bound_endpoint`.
    """
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        _apply_security(sock, bind=bind)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _apply_security(sock: zmq.Socket, *, bind: bool) -> None:
    """The single place where CURVE keys will be applied (server side on bind,
    client side on connect). Plain TCP for now."""


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


# ---------------------------------------------------------------- socket sets


@dataclass
class StageSockets:
    """A stage's sockets: PULL work in, PUSH activations on, DEALER replies home."""

    pull: zmq.Socket
    push: zmq.Socket | None  # None on the final stage
    dealer: zmq.Socket

    def close(self) -> None:
        for sock in (self.pull, self.push, self.dealer):
            if sock is not None:
                sock.close(linger=0)


def open_stage_sockets(
    ctx: zmq.Context,
    listen: str,
    next_listen: str | None,
    return_endpoint: str,
    stage_id: str,
    hwm: int = 1000,
    max_message_bytes: int = -1,
) -> StageSockets:
    """Bind `listen`, connect to the next stage (if any) and to the driver.

    The DEALER identity is the stage id, so the driver's ROUTER knows which
    stage every reply came from.
    """
    opened: list[zmq.Socket] = []
    try:
        pull = make_socket(ctx, zmq.PULL, listen, bind=True, hwm=hwm, max_message_bytes=max_message_bytes)
        opened.append(pull)
        push = None
        if next_listen is not None:
            push = make_socket(ctx, zmq.PUSH, next_listen, bind=False, hwm=hwm)
            opened.append(push)
        dealer = make_socket(ctx, zmq.DEALER, return_endpoint, bind=False, hwm=hwm,
                             identity=stage_id.encode(), max_message_bytes=max_message_bytes)
    except BaseException:
        for sock in opened:
            sock.close(linger=0)
        raise
    return StageSockets(pull=pull, push=push, dealer=dealer)


@dataclass
class DriverSockets:
    """The driver's sockets: PUSH work to stage 0, ROUTER for every stage's replies."""

    push: zmq.Socket
    router: zmq.Socket

    def close(self) -> None:
        self.push.close(linger=0)
        self.router.close(linger=0)


def open_driver_sockets(
    ctx: zmq.Context,
    first_listen: str,
    return_endpoint: str,
    hwm: int = 1000,
    max_message_bytes: int = -1,
) -> DriverSockets:
    """Bind the return ROUTER first (stages connect to it), then connect to stage 0."""
    router = make_socket(ctx, zmq.ROUTER, return_endpoint, bind=True, hwm=hwm, max_message_bytes=max_message_bytes)
    try:
        push = make_socket(ctx, zmq.PUSH, first_listen, bind=False, hwm=hwm)
    except BaseException:
        router.close(linger=0)
        raise
    return DriverSockets(push=push, router=router)
