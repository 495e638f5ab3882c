"""Stop strings in streamed text: the first stage after detokenizing (api/server.py's TextStream),
before a chat answer is split into reasoning, content and tool calls (chat_output.py)."""

from __future__ import annotations

from skippy_zmq.text.holdback import held_back


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    Text that could still grow into a stop string is held back until the next
    piece settles it. Nothing emitted can be part of a later match: any suffix
    that was a stop-string prefix was held, not emitted.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit). After a hit, stop pushing."""
        buffer = self._held + text
        hits = [i for i in (buffer.find(stop) for stop in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        keep = held_back(buffer, self._stops)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held text, once no more text will come."""
        text, self._held = self._held, ""
        return text
