"""Formats whose calls are the rest of the output after a marker (Llama 3's `<|python_tag|>` or a
bare leading `{`, Mistral's `[TOOL_CALLS]`): text before the marker is content, everything from
the marker on is the calls.

`split_tail(text, markers, leading_json)` finds where the calls start; `TailCallStream` streams
content up to there and holds the rest until the end, when the format's parse decides: calls,
or (if they do not decode) the held text as content. So the stream reassembles to parse().
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from skippy_zmq.text.holdback import held_back
from skippy_zmq.text.tools.calls import ToolCall
from skippy_zmq.text.tools.validation import ToolSet

Parse = Callable[[str], "tuple[str | None, list[ToolCall]]"]
_DECODER = json.JSONDecoder()


def split_tail(text: str, markers: tuple[str, ...], leading_json: bool) -> int:
    """Where the calls start in text: the first marker, or (leading_json) a `{` that only
    whitespace precedes; -1 when neither is there."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if leading_json and text.lstrip().startswith("{"):
        found.append(len(text) - len(text.lstrip()))
    return min(found) if found else -1


def json_values(body: str, separators: str = "") -> list[Any] | None:
    """The JSON values body holds one after another (whitespace, and any of `separators`, between
    them); None if anything else is there or there are none."""
    values, position = [], 0
    while True:
        while position < len(body) and (body[position].isspace() or (values and body[position] in separators)):
            position += 1
        if position == len(body):
            return values or None
        try:
            value, position = _DECODER.raw_decode(body, position)
        except (ValueError, RecursionError):
            return None
        values.append(value)


def tail_content(text: str, start: int) -> str | None:
    """The content of an output whose calls start at `start`: the text before, right-stripped."""
    return text[:start].rstrip() or None


def keep_allowed(calls: list[ToolCall | None], toolset: ToolSet | None) -> list[ToolCall] | None:
    """The calls if every one decoded (None otherwise), the first only without parallel calls."""
    if not calls or any(call is None for call in calls):
        return None
    return calls if toolset is None or toolset.parallel else calls[:1]


class TailCallStream:
    """Streams content until the calls start, then holds the rest until flush()."""

    def __init__(self, parse: Parse, markers: tuple[str, ...], leading_json: bool) -> None:
        self._parse, self._markers, self._leading_json = parse, markers, leading_json
        self.calls: list[ToolCall] = []
        self._text = ""          # everything pushed
        self._cut = 0            # text[:cut] has been shown (minus held trailing whitespace)
        self._sent = ""          # the content sent so far
        self._holding = False
        self._done = False

    def push(self, text: str) -> list[dict[str, Any]]:
        if self._done:
            raise RuntimeError("TailCallStream: push after flush")
        self._text += text
        if self._holding:
            return []
        start = split_tail(self._text, self._markers, self._leading_json)
        if start >= 0:
            self._holding = True
            return self._show(start)
        if self._leading_json and not self._text.strip():
            return []   # only whitespace so far: a call may still start
        return self._show(len(self._text) - held_back(self._text, self._markers))

    def flush(self) -> list[dict[str, Any]]:
        if self._done:
            return []
        self._done = True
        content, calls = self._parse(self._text)
        rest = (content or "")[len(self._sent):]
        out: list[dict[str, Any]] = [{"content": rest}] if rest else []
        for call in calls:
            self.calls.append(call)
            out.append({"tool_calls": [call.to_delta(len(self.calls) - 1)]})
        return out

    def _show(self, end: int) -> list[dict[str, Any]]:
        """Content up to `end`, less trailing whitespace (a call may follow it)."""
        if end <= self._cut:
            return []
        self._cut = end
        body = self._text[:end].rstrip()
        piece = body[len(self._sent):]
        if not piece:
            return []
        self._sent = body
        return [{"content": piece}]
