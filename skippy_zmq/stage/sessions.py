"""Per-stage session table: which KV lane a session owns and how far its KV reaches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


class LanesBusy(Exception):
    """Every KV lane is held by another session."""


@dataclass
class Session:
    session_id: int
    lane: int
    length: int = 0                 # KV is valid for positions [0, length)
    request_id: int = 0
    sampler: Any = None             # final stage only
    pool: Any = None                # final stage, an embedding's prompt: its stage.pooling.Pool
    tokens: list[int] = field(default_factory=list)   # ids at positions [0, length) (prefix-store keys)
    last_used: float = field(default_factory=time.monotonic)

    # The one owner of how far the session reaches: auto-align, TRIM_SESSION, rejected drafts and
    # restores all go through these two, so KV length, token ids and the sampler's penalty
    # history never disagree.

    def truncate(self, position: int) -> None:
        """Forget everything at positions >= `position` (KV past it is overwritten before it is read)."""
        position = max(int(position), 0)
        if self.length > position:
            self.length = position
            del self.tokens[position:]
        if self.sampler is not None:
            self.sampler.truncate(self.length)

    def append(self, tokens: list[int]) -> None:
        """Record `tokens` at positions [length, length + len(tokens)) after their KV was written."""
        if self.sampler is not None:
            self.sampler.put(self.length, tokens)
        self.tokens.extend(tokens)
        self.length += len(tokens)

    def set_sampler(self, sampler: Any) -> None:
        """Sample this session with `sampler` (final stage), told what the session already holds."""
        held = self.tokens[sampler.length:self.length]
        if held:
            sampler.put(sampler.length, held)
        self.sampler = sampler

    def reset(self, tokens: list[int]) -> None:
        """The session now holds exactly `tokens` at [0, len) (a prefix restore)."""
        self.truncate(0)
        self.append(tokens)


class SessionTable:
    def __init__(self, lanes: int, idle_timeout_s: float = 300.0):
        self.lanes = lanes
        self.idle_timeout_s = idle_timeout_s
        self._free = list(range(lanes - 1, -1, -1))
        self._sessions: dict[int, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: int) -> bool:
        return session_id in self._sessions

    def get(self, session_id: int) -> Session | None:
        return self._sessions.get(session_id)

    def acquire(self, session_id: int, request_id: int = 0) -> Session:
        """The session's state, allocating a lane for a new session."""
        session = self._sessions.get(session_id)
        if session is None:
            if not self._free:
                raise LanesBusy(f"all {self.lanes} KV lanes are busy")
            session = Session(session_id, self._free.pop(), request_id=request_id)
            self._sessions[session_id] = session
        session.last_used = time.monotonic()
        if request_id:
            session.request_id = request_id
        return session

    def release(self, session_id: int) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._free.append(session.lane)
        return True

    def release_all(self) -> int:
        ids = list(self._sessions)
        for sid in ids:
            self.release(sid)
        return len(ids)

    def reclaim_idle(self, now: float | None = None) -> list[int]:
        """Free sessions idle past the deadline (their driver went away)."""
        now = time.monotonic() if now is None else now
        stale = [s.session_id for s in self._sessions.values() if now - s.last_used > self.idle_timeout_s]
        for sid in stale:
            self.release(sid)
        return stale
