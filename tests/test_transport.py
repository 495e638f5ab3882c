"""Transport over real TCP sockets on 127.0.0.1 (wildcard ports, linger 0)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from skippy_zmq.protocol import transport, wire
from skippy_zmq.protocol.wire import Kind, Message, WireDType
from procs import free_endpoint

WAIT_MS = 2000  # upper bound for things that must arrive; they return as soon as they do
ANY_PORT = "tcp://127.0.0.1:*"




def wait(sock: zmq.Socket, timeout_ms: int = WAIT_MS) -> bool:
    return bool(sock.poll(timeout_ms, zmq.POLLIN))


@pytest.fixture
def ctx() -> zmq.Context:
    return transport.context()


@pytest.fixture
def chain(ctx: zmq.Context) -> Iterator[tuple[transport.DriverSockets, transport.StageSockets]]:
    """A driver and one final stage, wired as in production."""
    listen, ret = free_endpoint(), free_endpoint()
    driver = transport.open_driver_sockets(ctx, listen, ret, max_message_bytes=1 << 20)
    stage = transport.open_stage_sockets(ctx, listen, None, ret, "stage-0", max_message_bytes=1 << 20)
    yield driver, stage
    stage.close()
    driver.close()


def test_context_is_process_wide() -> None:
    assert transport.context() is transport.context()


def test_make_socket_applies_options(ctx: zmq.Context) -> None:
    sock = transport.make_socket(ctx, zmq.DEALER, ANY_PORT, bind=True, hwm=7, linger_ms=0,
                                 identity=b"me", max_message_bytes=1234)
    try:
        assert sock.getsockopt(zmq.SNDHWM) == 7 and sock.getsockopt(zmq.RCVHWM) == 7
        assert sock.getsockopt(zmq.LINGER) == 0 and sock.getsockopt(zmq.MAXMSGSIZE) == 1234
        assert sock.getsockopt(zmq.IDENTITY) == b"me"
        assert transport.bound_endpoint(sock).startswith("tcp://127.0.0.1:")
    finally:
        sock.close()


def test_chain_and_return_roundtrip(chain: tuple[transport.DriverSockets, transport.StageSockets]) -> None:
    driver, stage = chain
    assert stage.push is None
    act = np.arange(3 * 64, dtype=np.float32).reshape(3, 64)
    request = Message(Kind.PREFILL, request_id=42, session_id=9, position=5,
                      tokens=np.array([1, 2, 3], dtype=np.int32), activation=act, extras={"t": 0.7})
    transport.send_message(driver.push, request)

    assert wait(stage.pull)
    frames = transport.recv_frames(stage.pull)
    assert len(frames) == 6 and all(isinstance(f, zmq.Frame) for f in frames)
    got = wire.decode(frames)
    assert (got.kind, got.request_id, got.session_id, got.position) == (Kind.PREFILL, 42, 9, 5)
    np.testing.assert_array_equal(got.activation, act)
    # The f32 activation is a view of the received zmq frame, not a copy.
    assert np.shares_memory(got.activation, np.frombuffer(frames[4].buffer, dtype=np.uint8))

    transport.send_message(stage.dealer, Message.predicted_tokens(42, [9], [77]))
    assert wait(driver.router)
    identity, reply_frames = transport.recv_routed(driver.router)
    assert identity == b"stage-0" and len(reply_frames) == 6
    reply = wire.decode(reply_frames)
    assert reply.kind is Kind.PREDICTED_TOKENS and reply.tokens.tolist() == [77]

    # The driver can address a stage by its identity.
    transport.send_routed(driver.router, b"stage-0", Message(Kind.HEARTBEAT))
    assert wait(stage.dealer)
    assert wire.decode(transport.recv_frames(stage.dealer)).kind is Kind.HEARTBEAT


def test_stage_forwards_to_next_stage(ctx: zmq.Context) -> None:
    downstream = transport.make_socket(ctx, zmq.PULL, ANY_PORT, bind=True)
    router = transport.make_socket(ctx, zmq.ROUTER, ANY_PORT, bind=True)
    stage = transport.open_stage_sockets(ctx, ANY_PORT, transport.bound_endpoint(downstream),
                                         transport.bound_endpoint(router), "s0", hwm=10)
    try:
        assert stage.push is not None
        act = np.ones((1, 16), dtype=np.float32)
        transport.send_message(stage.push, Message(Kind.DECODE, tokens=np.array([3], np.int32), activation=act),
                               WireDType.BF16)
        assert wait(downstream)
        got = wire.decode(transport.recv_frames(downstream))
        assert got.wire_dtype is WireDType.BF16 and got.activation.tolist() == act.tolist()
    finally:
        stage.close()
        downstream.close()
        router.close()


def test_oversize_frame_is_dropped_and_stage_keeps_serving(
    chain: tuple[transport.DriverSockets, transport.StageSockets],
) -> None:
    driver, stage = chain
    too_big = Message(Kind.PREFILL, tokens=np.zeros(1, np.int32), activation=np.zeros((1, 300_000), np.float32))
    transport.send_message(driver.push, too_big)  # 1.2 MB frame > 1 MiB MAXMSGSIZE
    assert not wait(stage.pull, 100)
    # libzmq dropped the connection, not the socket: the PUSH reconnects and later work arrives.
    transport.send_message(driver.push, Message(Kind.STOP, session_id=1))
    assert wait(stage.pull)
    assert wire.decode(transport.recv_frames(stage.pull)).kind is Kind.STOP
