"""What a stage's own software costs per step, beside its compute: measured on the host (inside
its cgroup, so a host under a CPU quota pays for its Python at the quota's rate, like its layers).

A stage receives a step, decodes it, checks and places its rows, runs them, appends their tokens,
builds its trace and the outbound message, and sends it (stage/loop.py, stage/worker.py).
`bench cluster`'s telemetry showed this receive-to-send time less the compute at 0.35-0.5 ms a
stage on the loaded 2-core test machine, and nothing before serving measured it: the 1-stream
predictions came out short by that much a stage. `handle_ms` times the real path: a real
StageWorker over the measuring runner handles real DECODE frames (wire.decode, worker.handle, the
outbound's wire.encode); its software is that time less the compute its own trace reports.

No sockets here: a message's send and receive over ZeroMQ is measure.py's `message_ms`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

SESSION_BASE = 1      # the measuring sessions' ids (a private SessionTable: nothing else shares them)


def _frames(rows: int, width: int) -> list[bytes]:
    """A DECODE of `rows` rows (one session each, position 0: each call re-runs the same position,
    so the sessions never grow), encoded as the previous stage sends it."""
    from skippy_zmq.protocol import wire

    msg = wire.Message(wire.Kind.DECODE, 1, SESSION_BASE, position=0, tokens=np.zeros(rows, np.int32),
                       positions=np.zeros(rows, np.int32),
                       sessions=np.arange(SESSION_BASE, SESSION_BASE + rows, dtype=np.uint64),
                       activation=np.zeros((rows, width), np.float32))
    msg.extras["trace"] = [{"stage": "before", "compute_ms": 0.0, "rows": rows}]
    return [bytes(f) for f in wire.encode(msg)]


def handle_ms(runner: Any, rows: int, lanes: int, repeats: int = 5, calls: int = 10) -> dict[str, float]:
    """{"handle_ms", "compute_ms", "software_ms"}: medians over `repeats` samples of `calls` steps
    through a real StageWorker on `runner` (its KV holding `lanes` lanes) as a middle stage
    (activations in, activations out)."""
    from skippy_zmq.protocol import wire
    from skippy_zmq.stage.sessions import SessionTable
    from skippy_zmq.stage.types import StageInfo
    from skippy_zmq.stage.worker import StageWorker

    worker = StageWorker(StageInfo("measure", first=False, last=False, width=runner.cfg.d_model),
                         runner, SessionTable(lanes))
    frames = _frames(rows, runner.cfg.d_model)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = worker.handle(wire.decode(frames))
        wire.encode(out[0].message)
        total = 1000 * (time.perf_counter() - t0)
        if len(out) != 1 or out[0].message.kind != wire.Kind.DECODE:
            raise RuntimeError(f"the measuring stage answered {[o.message.kind.name for o in out]}")
        return total, float(out[0].message.extras["trace"][-1]["compute_ms"])

    step()   # compiles, first-run costs
    totals, computes, software = [], [], []
    for _ in range(repeats):
        samples = [step() for _ in range(calls)]
        totals.append(statistics.median(t for t, _ in samples))
        computes.append(statistics.median(c for _, c in samples))
        software.append(statistics.median(t - c for t, c in samples))
    return {"handle_ms": round(statistics.median(totals), 4), "compute_ms": round(statistics.median(computes), 4),
            "software_ms": round(max(0.0, statistics.median(software)), 4)}


# ---------------------------------------------------------------- the driver's share of a token
#
# At one stream the driver receives the final stage's tokens, hands them to the request's consumer
# (another thread: the API's event loop, or a blocking caller), and sends the next step to stage 0
# (engine/pipeline.py). `bench cluster` measured 2.5-3 ms a token there on the loaded test machine
# (the token's time less the stages' receive-to-send and the transits between them), where the
# two measured hops predict under 0.1. `driver_ms` times that shape for real: a loop thread that
# polls, decodes a real reply and hands it to a consumer thread through a queue, then encodes and
# sends the next step, against an echo process on this machine; less a bare round trip to the
# same echo (the two hops the planner charges already).

ECHO_READY = b"ready\n"
RING_ROUNDS = 200
RING_TIMEOUT_S = 10.0


def serve_echo(endpoint: str, rounds: int) -> None:
    """PULL bound at `endpoint`, each message's frames back on a PUSH to the endpoint a first frame
    names; at most `rounds` messages, each within RING_TIMEOUT_S (or done)."""
    import sys

    import zmq

    from skippy_zmq.protocol.transport import make_socket

    ctx = zmq.Context()
    pull = make_socket(ctx, zmq.PULL, endpoint, bind=True, max_message_bytes=1 << 20)
    push = None
    sys.stdout.buffer.write(ECHO_READY)
    sys.stdout.flush()
    try:
        for _ in range(rounds):
            if not pull.poll(int(1000 * RING_TIMEOUT_S)):
                break
            reply_to, *frames = pull.recv_multipart(copy=False)
            if push is None:
                push = make_socket(ctx, zmq.PUSH, reply_to.bytes.decode(), bind=False)
            push.send_multipart(frames, copy=False)
    finally:
        pull.close(linger=0)
        if push is not None:
            push.close(linger=0)
        ctx.term()


def _ring(send: Any, pull: Any, frames: list, rounds: int, through_loop: bool) -> float:
    """Median ms of `rounds` echoes: bare (send, wait, receive) or through the driver's loop shape."""
    import queue
    import threading

    from skippy_zmq.protocol import wire

    events: queue.Queue = queue.Queue()
    consumer = threading.Thread(target=lambda: [None for _ in iter(events.get, None)], daemon=True)
    consumer.start()
    times = []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            send(frames)
            if not pull.poll(int(1000 * RING_TIMEOUT_S)):
                raise TimeoutError(f"the echo did not answer within {RING_TIMEOUT_S:g} s")
            got = pull.recv_multipart(copy=False)
            if through_loop:
                msg = wire.decode(got)
                events.put((msg.request_id, msg.tokens.tolist()))
                frames = [bytes(f) for f in wire.encode(msg)]
            times.append(1000 * (time.perf_counter() - t0))
    finally:
        events.put(None)
        consumer.join(timeout=RING_TIMEOUT_S)
    return statistics.median(times)


def driver_ms(rounds: int = RING_ROUNDS) -> dict[str, float]:
    """{"ring_ms", "bare_ms", "driver_ms"}: this machine's driver share of a token (above)."""
    import subprocess
    import sys

    import zmq

    from skippy_zmq.protocol import transport

    ctx = zmq.Context()
    pull = transport.make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:*", bind=True, max_message_bytes=1 << 20)
    port = _free_port()
    echo = subprocess.Popen([sys.executable, "-m", "skippy_zmq.cluster.software", f"tcp://127.0.0.1:{port}",
                             str(2 * rounds + 4)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    push = None
    try:
        if echo.stdout.readline() != ECHO_READY:
            raise RuntimeError("the echo process did not start")
        push = transport.make_socket(ctx, zmq.PUSH, f"tcp://127.0.0.1:{port}", bind=False)
        back = transport.bound_endpoint(pull).encode()
        send = lambda frames: push.send_multipart([back, *frames], copy=False)   # noqa: E731
        frames = [bytes(f) for f in _decode_reply_frames()]
        _ring(send, pull, frames, 4, True)    # connects, wakes both ends
        ring = _ring(send, pull, frames, rounds, True)
        bare = _ring(send, pull, frames, rounds, False)
    finally:
        if push is not None:
            push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        echo.kill()
        echo.wait()
    return {"ring_ms": round(ring, 4), "bare_ms": round(bare, 4), "driver_ms": round(max(0.0, ring - bare), 4)}


def _decode_reply_frames() -> list:
    """A final stage's 1-row reply as it arrives at the driver (a token, its trace)."""
    from skippy_zmq.protocol import wire

    msg = wire.Message(wire.Kind.PREDICTED_TOKENS, 1, SESSION_BASE, position=0, tokens=np.zeros(1, np.int32),
                       positions=np.zeros(1, np.int32), sessions=np.full(1, SESSION_BASE, np.uint64))
    msg.extras["trace"] = [{"stage": f"s{i}", "compute_ms": 1.0, "rows": 1, "recv_ns": 0, "send_ns": 0}
                           for i in range(3)]
    return wire.encode(msg)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    import sys

    serve_echo(sys.argv[1], int(sys.argv[2]))
