"""Link measurements: the round trip and bandwidth of a ZeroMQ link, for the planner's hop costs
(ops/speed.py `Links`: a hop costs rtt / 2 + bytes / bandwidth).

`measure_link(ask)` times `PINGS` empty round trips (the median is the round trip) and one
transfer of `TRANSFER_BYTES` answered in one message (its time less a round trip is the
bandwidth's). `ask(size)` sends one request asking for `size` bytes back and returns when they
came; the caller owns the socket, its authentication and its deadline. The driver's cluster link
answers PING with PONG (cluster/server.py); `python -m skippy_zmq.cluster.probe ENDPOINT` is a
plain echo server for a test bench's hosts (devtools/bench/cluster.py). No JAX.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

PINGS = 5
TRANSFER_BYTES = 2 << 20
MAX_PROBE_BYTES = 4 << 20      # the most a PONG carries back (a cap, so a probe cannot be a flood)
PROBE_TIMEOUT_S = 10.0         # the whole measurement's deadline (each `ask` keeps it)


def measure_link(ask: Callable[[int], None], pings: int = PINGS, transfer_bytes: int = TRANSFER_BYTES
                 ) -> dict[str, float]:
    """{"rtt_ms", "bytes_per_s", "transfer_bytes"} of the link `ask` talks over (module docstring)."""
    ask(0)   # connects, and wakes both ends
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        ask(0)
        rtts.append(1000 * (time.perf_counter() - t0))
    rtt = statistics.median(rtts)
    t0 = time.perf_counter()
    ask(transfer_bytes)
    spent_ms = 1000 * (time.perf_counter() - t0) - rtt
    # a transfer faster than the timer can tell from a round trip: say so by a rate, not infinity
    rate = transfer_bytes / max(spent_ms, 1e-3) * 1000
    return {"rtt_ms": round(rtt, 4), "bytes_per_s": round(rate), "transfer_bytes": transfer_bytes}


def serve_echo(endpoint: str, requests: int = 64) -> None:
    """Answer `requests` requests on a REP socket bound at `endpoint`, each with the number of
    bytes it asks for (an ASCII integer, capped at MAX_PROBE_BYTES)."""
    import zmq

    from skippy_zmq.protocol.transport import make_socket

    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.REP, endpoint, bind=True, max_message_bytes=64)
    print("ready", flush=True)
    try:
        for _ in range(requests):
            if not sock.poll(int(1000 * PROBE_TIMEOUT_S * 6)):
                break   # nobody asked within the deadline: done
            asked = sock.recv()
            sock.send(bytes(min(MAX_PROBE_BYTES, int(asked) if asked.isdigit() else 0)))
    finally:
        sock.close(linger=0)
        ctx.term()


def echo_client(endpoint: str) -> tuple[Callable[[int], None], Callable[[], None]]:
    """(ask, close) over a REQ socket to a serve_echo endpoint; `ask` raises TimeoutError after PROBE_TIMEOUT_S."""
    import zmq

    from skippy_zmq.protocol.transport import make_socket

    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.REQ, endpoint, bind=False, max_message_bytes=MAX_PROBE_BYTES)

    def ask(size: int) -> None:
        sock.send(str(size).encode())
        if not sock.poll(int(1000 * PROBE_TIMEOUT_S)):
            raise TimeoutError(f"no answer from {endpoint} within {PROBE_TIMEOUT_S:g} s")
        sock.recv()

    def close() -> None:
        sock.close(linger=0)
        ctx.term()

    return ask, close


if __name__ == "__main__":
    serve_echo(sys.argv[1])
