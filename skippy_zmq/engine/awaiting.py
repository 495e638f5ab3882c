"""What the scheduler has sent and still waits to hear about, by request id.

Three kinds of wait: rows whose reply carries tokens (DECODE messages, windows
sent ahead and fused restores), restore tries (whose ACK says hit or miss) and
prefill chunks (whose ACKs give back prefill credit). Each has a reply
deadline; a session taken out of a message (a re-prefill) makes its part of
the reply stale.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sent:
    """One message in flight: the sessions it still answers for and when it left."""
    sessions: set[int]
    sent_at: float
    ahead: bool = False   # windows sent ahead (and steps run on) do not count against micro_batches
    run_on: int = 0       # steps the stage may still run on from this one's samples (request ids reserved)


class Awaiting:
    def __init__(self) -> None:
        self.rows: dict[int, Sent] = {}       # request id of a DECODE (or fused restore) -> its sessions
        self.restores: dict[int, Sent] = {}   # request id of a restore try -> its session
        self.prefills: dict[int, float] = {}  # request id of a prefill chunk -> sent time

    def micro_batches(self) -> int:
        """DECODE messages in flight that count against micro_batches (not windows sent ahead)."""
        return sum(not sent.ahead for sent in self.rows.values())

    def drop_session(self, request_id: int, session_id: int) -> None:
        """An ERROR about one row: the rest of its message is still awaited."""
        sent = self.rows.get(request_id)
        if sent is not None:
            sent.sessions.discard(session_id)
            if not sent.sessions:
                del self.rows[request_id]
        self.prefills.pop(request_id, None)
        self.restores.pop(request_id, None)

    def forget_session(self, session_id: int) -> None:
        """A session is re-prefilled: whatever it had in flight is stale."""
        for pending in (self.rows, self.restores):
            for request_id, sent in list(pending.items()):
                sent.sessions.discard(session_id)
                if not sent.sessions:
                    del pending[request_id]

    def expire(self, now: float, timeout_s: float) -> list[int]:
        """Drop what waited past `timeout_s`; the sessions of rows and restores that did (to fail).
        An expired prefill chunk only frees its credit; the decode timeout catches its session."""
        sessions = []
        for pending in (self.rows, self.restores):
            for request_id in [r for r, sent in pending.items() if now - sent.sent_at > timeout_s]:
                sessions += pending.pop(request_id).sessions
        for request_id, sent_at in list(self.prefills.items()):
            if now - sent_at > timeout_s:
                del self.prefills[request_id]
        return sessions

    def clear(self) -> None:
        self.rows.clear()
        self.restores.clear()
        self.prefills.clear()
