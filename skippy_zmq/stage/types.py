"""Small types shared by the stage worker and its route handlers."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from skippy_zmq.protocol.wire import Message

# OWN: the stage's own next step (run-on); RING: the next step, from the last stage to the first
NEXT, DRIVER, OWN, RING = "next", "driver", "own", "ring"


@dataclass(frozen=True)
class Outbound:
    to: str           # NEXT, DRIVER, OWN or RING
    message: Message


@dataclass(frozen=True)
class StageInfo:
    stage_id: str
    first: bool
    last: bool
    width: int
    ring: bool = False   # the last stage sends each step it runs on to the first (Topology.ring)
    # Random per process start, so the driver (and the fence) can tell a replacement from the one it replaced.
    incarnation: int = field(default_factory=lambda: secrets.randbits(32) or 1)


class StageFault(Exception):
    """A request this stage cannot serve; becomes an ERROR reply to the driver."""

    def __init__(self, reason: str, code: str):
        super().__init__(reason)
        self.reason, self.code = reason, code
