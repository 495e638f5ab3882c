"""Connection-level limits on uvicorn's h11 protocol: what the ASGI app never sees.

uvicorn bounds idle keep-alive connections and (limit_concurrency) answers 503 over a count,
but a connection that sends its request line and headers a byte every few seconds (slowloris)
is held forever, and one client may take every slot. Here each connection:

- is refused at once (503 / 429, then closed) past `max_connections` open connections, or past
  `max_connections_per_client` from its address;
- must finish its request headers within `header_timeout_s` of connecting (or of the previous
  response, on a keep-alive connection), else it is closed (with a 408 if it had started them);
- gets 431 when its request line and headers outgrow `max_header_bytes`.

The body deadline is per request, in the ASGI layer (http_guard.Guard.body_deadline).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from skippy_zmq.config.http import EdgeConfig

STATUS_TEXT = {400: "Bad Request", 408: "Request Timeout", 429: "Too Many Requests",
               431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def raw_response(status: int, message: str) -> bytes:
    """A whole closing HTTP/1.1 response with an OpenAI-style error body, written outside h11
    (no request has been parsed, so h11 has no response to send)."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500 else
                                 "invalid_request_error", "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {STATUS_TEXT[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with connection caps and a header deadline (see the module doc)."""

    def __init__(self, *args: Any, edge: EdgeConfig, refused: Callable[[int], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.edge, self.refused = edge, refused   # refused(status): count a refusal (metrics)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        refusal = self._over_cap()
        if refusal is not None:
            self._refuse(*refusal)
            return
        self._arm_header_deadline()

    def _over_cap(self) -> tuple[int, str] | None:
        if len(self.connections) > self.edge.max_connections:   # the set counts this connection
            return 503, f"too many open connections (max_connections {self.edge.max_connections}); retry later"
        address = self.client[0] if self.client else None
        same = sum(1 for c in self.connections if c.client and c.client[0] == address)
        if address is not None and same > self.edge.max_connections_per_client:
            return 429, (f"too many open connections from {address} "
                         f"(max_connections_per_client {self.edge.max_connections_per_client})")
        return None

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        self.refused(status)
        if not self.transport.is_closing():
            self.transport.write(raw_response(status, message))
            self.transport.close()

    def _arm_header_deadline(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.edge.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE:   # a request is in (header_timeout_s is not its limit)
            return
        if self.conn.trailing_data[0]:   # part of a request line and headers: say why it is cut
            self._refuse(408, f"request headers not received within {self.edge.header_timeout_s:g} s")
        elif not self.transport.is_closing():
            # Nothing sent: close quietly. A 408 here could race a keep-alive client's next
            # request and be read as its answer.
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_bytes(data) > self.edge.max_header_bytes:
            self._refuse(431, f"request line and headers exceed {self.edge.max_header_bytes} bytes")
            return
        super().data_received(data)

    def _header_bytes(self, data: bytes) -> int:
        """The length of the request head buffered so far with `data` (to its blank line if it has
        one; h11's own limit only counts a head it has not yet seen the end of)."""
        head = self.conn.trailing_data[0] + data
        ends = [i for i in (head.find(b"\r\n\r\n"), head.find(b"\n\n")) if i >= 0]
        return min(ends) if ends else len(head)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:   # a request's headers were parsed: its body has its own deadline
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()   # the next request on this keep-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request: say why, with 431 when it was the header size."""
        buffered = len(self.conn.trailing_data[0])
        if buffered > self.edge.max_header_bytes:
            self._refuse(431, f"request line and headers exceed {self.edge.max_header_bytes} bytes")
        else:
            self._refuse(400, "malformed HTTP request (request line or headers)")


def uvicorn_config(app: Any, edge: EdgeConfig, refused: Callable[[int], None] = lambda status: None,
                   **kwargs: Any) -> uvicorn.Config:
    """A uvicorn Config that serves `app` with the edge's connection limits; `refused(status)` hears
    of each connection turned away before the app saw a request."""
    return uvicorn.Config(
        app, http=functools.partial(GuardedH11Protocol, edge=edge, refused=refused),  # type: ignore[arg-type]
        # uvicorn counts the asking connection too; the protocol refuses connections past
        # max_connections itself, so this bounds the requests being served at once.
        limit_concurrency=edge.max_connections + 1, timeout_keep_alive=edge.keep_alive_s,
        h11_max_incomplete_event_size=edge.max_header_bytes, access_log=False, **kwargs)
