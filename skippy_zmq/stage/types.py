"""Small types shared by the stage worker and its route handlers."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from skippy_zmq.protocol.wire import Message

NEXT, DRIVER, OWN = "next", "driver", "own"   # OWN: the stage's own next step (run-on)


@dataclass(frozen=True)
class Outbound:
    to: str           # NEXT, DRIVER or OWN
    message: Message


@dataclass(frozen=True)
class StageInfo:
    stage_id: str
    first: bool
    last: bool
    width: int
    # Random per process start, so the driver (and the fence) can tell a replacement from the one it replaced.
    incarnation: int = field(default_factory=lambda: secrets.randbits(32) or 1)


class StageFault(Exception):
    """A request this stage cannot serve; becomes an ERROR reply to the driver."""

    def __init__(self, reason: str, code: str):
        super().__init__(reason)
        self.reason, self.code = reason, code
