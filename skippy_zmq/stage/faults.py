"""Fault injection for chaos runs and tests; inert unless SKIPPY_FAULT_DIR is set.

`DIR/<stage id>.json` holding {"kind": "PREFILL", "nth": 2} arms the stage:
on receiving its nth message of that kind after the file appeared, it removes
the file and SIGKILLs itself before acting on the message. That is the most
abrupt death there is, at an exact point of the protocol, so a chaos scenario
("die in a prefill chunk", "die while a restore is in flight") is repeatable
instead of a race against a timer. A replacement finds no file and lives.
With "window": true only DECODEs that carry a verify window (a row of more
than one token) count, so a stage dies with speculation in flight.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from skippy_zmq.protocol.wire import Kind, Message

ENV = "SKIPPY_FAULT_DIR"


def arm(directory: Path, stage_id: str, kind: Kind, nth: int, window: bool = False) -> Path:
    """Write the arming file (the chaos tool's side). Atomic, so a stage never reads half of it.
    `window`: count only messages with a row of more than one token (a verify window)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stage_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"kind": kind.name, "nth": nth, **({"window": True} if window else {})}))
    tmp.replace(path)
    return path


@dataclass
class FaultInjector:
    path: Path
    armed: tuple[int, int] | None = None   # (inode, mtime) of the file being counted against
    kind: str = ""
    nth: int = 0
    window: bool = False
    seen: int = 0

    @classmethod
    def from_env(cls, stage_id: str) -> "FaultInjector | None":
        directory = os.environ.get(ENV)
        return cls(Path(directory) / f"{stage_id}.json") if directory else None

    def on_message(self, kind: Kind, message: Message | None = None) -> None:
        """Count a message; `message` lets a window fault tell a verify window from a plain DECODE."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self.armed = None
            return
        if self.armed != (st.st_ino, st.st_mtime_ns):
            try:
                spec = json.loads(self.path.read_text())
                self.kind, self.nth, self.seen = str(spec["kind"]), int(spec["nth"]), 0
                self.window = bool(spec.get("window", False))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("ignoring unreadable fault file {}: {}", self.path, exc)
                return
            self.armed = (st.st_ino, st.st_mtime_ns)
        if kind.name != self.kind:
            return
        if self.window:
            if message is None or not bool((message.row_lengths > 1).any()):
                return
        self.seen += 1
        if self.seen >= self.nth:
            self.path.unlink(missing_ok=True)
            logger.warning("fault injection: dying on {}{} #{} as {} asks", kind.name,
                           " window" if self.window else "", self.seen, self.path)
            os.kill(os.getpid(), signal.SIGKILL)
