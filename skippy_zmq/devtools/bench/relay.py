"""A TCP relay that holds every byte for a fixed one-way delay: a slow network link between two
processes on one machine, applied the same way to any engine.

The issue asked for `tc netem` inside the network-namespace harness; this machine's kernel has no
netem (nor fq, so no eBPF departure times): `tc qdisc add ... netem` answers "Specified qdisc kind is
unknown". The relay is the portable equivalent of netem's `delay`: a process listens on a port of its
own and forwards each connection to the real server, and every chunk read in either direction is
written on `delay` seconds after it was read, in order. Like netem without a rate, it adds latency,
not a bandwidth limit: several messages can be on the way at once, and a bulk transfer (llama.cpp
uploading weights to an rpc-server) is not held to one window per round trip.

Used by `bench peers` (the 20 ms per hop pipeline rows): our stages dial each other and the driver
through relays (the topology's `advertise` / `return_advertise` keys), and llama-server dials each
rpc-server through one, so every one-way message between two processes of either engine takes the
same extra time.

    python -m skippy_zmq.devtools.bench.relay --delay-ms 20 LISTEN_PORT:HOST:PORT [...]

prints `ready` once every listener is bound, and runs until killed.
"""

from __future__ import annotations

import argparse
import collections
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

CHUNK = 1 << 16


class _Pipe:
    """One direction of one connection: a reader thread stamps each chunk with its due time; a
    writer thread sends it then. Closing the source closes the destination's write side once every
    chunk before it has gone."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        self.src, self.dst, self.delay_s = src, dst, delay_s
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.arrived = threading.Condition()
        for target in (self._read, self._write):
            threading.Thread(target=target, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.src.recv(CHUNK)
            except OSError:
                data = b""
            with self.arrived:
                self.queue.append((time.monotonic() + self.delay_s, data))
                self.arrived.notify()
            if not data:
                return

    def _write(self) -> None:
        while True:
            with self.arrived:
                while not self.queue:
                    self.arrived.wait()
                due, data = self.queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)     # the link's latency; later chunks are due later still
            try:
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
            except OSError:
                return


def serve(server: socket.socket, host: str, port: int, delay_s: float) -> None:
    """Accept on `server` forever; each connection is relayed to host:port."""
    listen_port = server.getsockname()[1]
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection((host, port), timeout=10)
        except OSError as err:   # not listening yet: the dialler retries (ZeroMQ does); say anything else
            if not isinstance(err, ConnectionRefusedError):
                print(f"[relay] {listen_port} -> {host}:{port}: {err}", file=sys.stderr, flush=True)
            client.close()
            continue
        upstream.settimeout(None)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _Pipe(client, upstream, delay_s)
        _Pipe(upstream, client, delay_s)


def parse_route(text: str) -> tuple[int, str, int]:
    listen, host, port = text.split(":")
    return int(listen), host, int(port)


@contextmanager
def relays(routes: list[tuple[int, str, int]], delay_ms: float) -> Iterator[None]:
    """A relay process for `routes` (listen port, host, port), each with `delay_ms` each way."""
    from skippy_zmq.ops.launch import stop_processes

    proc = subprocess.Popen([sys.executable, "-m", "skippy_zmq.devtools.bench.relay", "--delay-ms", str(delay_ms),
                             *(f"{a}:{h}:{p}" for a, h, p in routes)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"relay did not start (exit {proc.poll()}): {line!r}")
        yield
    finally:
        stop_processes([proc])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("routes", nargs="+", type=parse_route, help="LISTEN_PORT:HOST:PORT")
    args = parser.parse_args(argv)
    servers = [socket.create_server(("127.0.0.1", listen)) for listen, _, _ in args.routes]
    for server, (_, host, port) in zip(servers, args.routes):
        threading.Thread(target=serve, args=(server, host, port, args.delay_ms / 1000), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
