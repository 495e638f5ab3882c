"""The cluster link's messages: [kind, JSON header, (data)] frames between a worker's DEALER and the
driver's ROUTER (CURVE; the worker holds a join token's key).

    worker -> driver   HELLO {name, report}          FETCH {path, offset, length}     STARTED {stage, pid}
                       MEASURED {speed | error}      (split: measured, the answer to MEASURE)
                       PING {size}                   (a link probe: cluster/probe.py)
                       PROBED {links}                (its links to the peers PROBE named: cluster/peers.py)
    driver -> worker   MEASURE {model_json, weights, dtype, device}   (split: measured, before ASSIGN)
                       ASSIGN {stage, layers, digest, files, max_chunk_bytes}
                       START {topology, keys}        CHUNK {path, offset} + data      REFUSED {reason}
                       PONG {size} (+ size bytes, at most probe.MAX_PROBE_BYTES)
                       PROBE {peers: [{name, endpoint, key}], allow}   (split: measured, before planning)

Every header is a JSON object of at most MAX_HEADER_BYTES, checked before it is used; a message
that breaks a rule is a LinkError naming the rule. No JAX.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import zmq

PROTOCOL = 1
KINDS = {"HELLO", "FETCH", "STARTED", "MEASURED", "MEASURE", "ASSIGN", "START", "CHUNK", "REFUSED", "PING", "PONG",
         # a serving worker's heartbeat, and a re-cut's steps (cluster/rebalance.py)
         "BEAT", "PREPARE", "PREPARED", "HALT", "HALTED", "REBALANCE", "REBALANCED",
         # worker-to-worker links (cluster/peers.py)
         "PROBE", "PROBED"}
MAX_HEADER_BYTES = 16 << 20     # START carries the topology and keys, ASSIGN a stage's file table
MAX_WORKER_MESSAGE = 64 << 10   # what the driver accepts from a worker (HELLO with its report is the largest)


class LinkError(ValueError):
    """A cluster message that breaks the protocol; the message says how."""


@dataclass(frozen=True)
class Message:
    kind: str
    header: dict[str, Any]
    data: bytes | memoryview | None = None


def frames(msg: Message) -> list[Any]:
    out: list[Any] = [msg.kind.encode(), json.dumps(msg.header, separators=(",", ":")).encode()]
    if msg.data is not None:
        out.append(msg.data)
    return out


def parse(parts: list[Any]) -> Message:
    """Frames (bytes or zmq.Frame) -> Message; LinkError for anything malformed."""
    if len(parts) not in (2, 3):
        raise LinkError(f"expected 2 or 3 frames, got {len(parts)}")
    raw = [p.bytes if isinstance(p, zmq.Frame) else bytes(p) for p in parts[:2]]
    kind = raw[0].decode("ascii", errors="replace")
    if kind not in KINDS:
        raise LinkError(f"unknown message kind {kind[:16]!r}")
    if len(raw[1]) > MAX_HEADER_BYTES:
        raise LinkError(f"{kind} header is {len(raw[1])} bytes (cap {MAX_HEADER_BYTES})")
    try:
        header = json.loads(raw[1])
    except ValueError:
        raise LinkError(f"{kind} header is not JSON") from None
    if not isinstance(header, dict):
        raise LinkError(f"{kind} header is not a JSON object")
    data = None
    if len(parts) == 3:
        data = parts[2].buffer if isinstance(parts[2], zmq.Frame) else parts[2]
    if kind == "CHUNK" and data is None:
        raise LinkError(f"{kind}: a data frame is required")
    if kind not in ("CHUNK", "PONG") and data is not None:
        raise LinkError(f"{kind}: unexpected data frame")
    return Message(kind, header, data)


def field(msg: Message, name: str, kind: type, low: int | None = None) -> Any:
    """A header field of the given type (an int at least `low`); LinkError names a missing or bad one."""
    value = msg.header.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise LinkError(f"{msg.kind}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    if low is not None and value < low:
        raise LinkError(f"{msg.kind}: field {name!r} must be at least {low}, got {value}")
    return value
