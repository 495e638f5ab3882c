"""Calls written as JSON between tags: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes / Qwen2.5 convention, which the generic tool prompt also asks for).

`parse_tool_calls` reads a finished output; `ToolCallStream` reads one as it
streams, and gives the same content and calls for any split of the text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from skippy_zmq.text.holdback import held_back
from skippy_zmq.text.tools.calls import ToolCall, call_from_json, new_call_id
from skippy_zmq.text.tools.validation import ToolSet

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


_DECODER = json.JSONDecoder()


def _block(text: str, start: int, toolset: ToolSet | None, new_id: Callable[[], str],
           final: bool) -> tuple[ToolCall | None, int] | None:
    """The block whose body starts at text[start] (just after <tool_call>): (its call, where it
    ends) or (None, where it ends) for a bad one; None while more text could still change that
    (final: never).

    The body is one JSON value read as JSON (so a "</tool_call>" inside one of its strings
    does not end it), then whitespace and </tool_call>, or the end of the output. A bad block
    (not such a value, or not an allowed call) ends at the first </tool_call>, or the end.
    """
    close = text.find(TOOL_CALL_CLOSE, start)
    bad = (None, close + len(TOOL_CALL_CLOSE) if close >= 0 else len(text))
    try:
        value, end = _DECODER.raw_decode(text, len(text) - len(text[start:].lstrip()))
    except (ValueError, RecursionError):
        return bad if final else None
    rest = text[end:].lstrip()
    after = len(text) - len(rest)
    if rest.startswith(TOOL_CALL_CLOSE) or (final and not rest):
        call = call_from_json(value, toolset, new_id)
        return bad if call is None else (call, after + (len(TOOL_CALL_CLOSE) if rest else 0))
    if not final and TOOL_CALL_CLOSE.startswith(rest):
        return None
    return bad if final or close >= 0 else None


def _bare_calls(text: str, toolset: ToolSet, new_id: Callable[[], str]) -> list[ToolCall] | None:
    """The calls of a bare JSON answer (an object or a list of them), or None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from_json(item, toolset, new_id) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls if toolset.parallel else calls[:1]


def parse_tool_calls(
    text: str, toolset: ToolSet | None = None, new_id: Callable[[], str] = new_call_id
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output.

    Each `<tool_call>JSON</tool_call>` block whose JSON is {"name": str,
    "arguments": object (or a string holding one)} is a call (the JSON is read
    as JSON, so a "</tool_call>" inside its strings does not close it); a last
    block left unclosed at the end counts too if its JSON is whole. A block that does
    not decode (bad JSON, no name, a function the toolset does not allow)
    stays in the content, tags and all. With `parallel` off, blocks after the
    first call are dropped. Content: the text outside the calls, with the
    whitespace just before each call dropped, and leading whitespace dropped
    where only calls came before; None when there are calls and no other
    text; the text itself when there are none. For required / named choices
    a bare JSON answer (a call object or a list of them) is also read as calls.
    """
    if toolset is not None and toolset.constrained and TOOL_CALL_OPEN not in text:
        bare = _bare_calls(text.strip(), toolset, new_id)
        if bare is not None:
            return None, bare
    content, calls, position = "", [], 0
    after_call = False
    cursor = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, cursor)
        if start < 0:
            break
        call, block_end = _block(text, start + len(TOOL_CALL_OPEN), toolset, new_id, final=True)
        if call is None:
            cursor = block_end
            if block_end >= len(text):
                break
            continue
        segment = text[position:start]
        if after_call and not content:
            segment = segment.lstrip()
        content += segment.rstrip()
        if toolset is None or toolset.parallel or not calls:
            calls.append(call)
        after_call, position = True, block_end
        cursor = block_end
    if not calls:
        return text, []
    segment = text[position:]
    if not content:
        segment = segment.lstrip()
    content += segment
    return content or None, calls


@dataclass
class ToolCallStream:
    """Streamed text in, OpenAI `delta` objects out; reassembles to parse_tool_calls.

    push(text) and, at the end, flush() return lists of deltas, each either
    ``{"content": str}`` or ``{"tool_calls": [{"index", "id", "type":
    "function", "function": {"name", "arguments"}}]}``. A call is sent whole,
    in one delta, once its block closes (its JSON is checked first, so a bad
    block can still go out as text; a block whose JSON is not yet whole is
    held, as its closing tag may be inside a string). Text that might be the start of
    <tool_call>, a block not yet closed, and whitespace that might precede a
    call are held back. Concatenating the content deltas gives
    parse_tool_calls' content ("" for None) and the tool-call deltas give its
    calls, for any split of the text into pieces. For required / named
    choices an output starting with "{" or "[" (a bare JSON answer) is held
    whole until flush().
    """

    toolset: ToolSet | None = None
    new_id: Callable[[], str] = new_call_id
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._buffer = ""          # outside a block: undecided text; inside: the block so far
        self._inside = False
        self._pending_ws = ""      # trailing whitespace held in case a call follows it
        self._emitted = False      # whether any content has gone out
        self._after_call = False
        self._bare: bool | None = None if self.toolset is not None and self.toolset.constrained else False
        self._done = False

    def push(self, text: str) -> list[dict[str, Any]]:
        if self._done:
            raise RuntimeError("ToolCallStream: push after flush")
        self._buffer += text
        if self._bare is None:
            stripped = self._buffer.lstrip()
            if not stripped:
                return []
            self._bare = stripped[0] in "{["
        if self._bare:
            return []
        return self._drain()

    def flush(self) -> list[dict[str, Any]]:
        if self._done:
            return []
        self._done = True
        out: list[dict[str, Any]] = []
        if self._bare:
            content, calls = parse_tool_calls(self._buffer, self.toolset, self.new_id)
            if content:
                out.append({"content": content})
            for call in calls:
                out.append(self._emit_call(call))
            return out
        out += self._drain(final=True)
        if self._pending_ws:
            out.append({"content": self._pending_ws})
            self._pending_ws = ""
        return out

    def _drain(self, final: bool = False) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if not self._inside:
                start = self._buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = 0 if final else held_back(self._buffer, (TOOL_CALL_OPEN,))
                    out += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._inside = True
            resolved = _block(self._buffer, 0, self.toolset, self.new_id, final)
            if resolved is None:
                return out   # the block is not settled yet
            call, end = resolved
            inner, self._buffer = self._buffer[:end], self._buffer[end:]
            self._inside = False
            out += self._content(TOOL_CALL_OPEN + inner) if call is None else self._call(call)

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self._after_call and not self._emitted:
            text = text.lstrip()
        if not text:
            return []
        combined = self._pending_ws + text
        body = combined.rstrip()
        self._pending_ws = combined[len(body):]
        if not body:
            return []
        self._emitted = True
        return [{"content": body}]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        self._pending_ws = ""
        self._after_call = True
        if self.toolset is not None and not self.toolset.parallel and self.calls:
            return []
        return [self._emit_call(call)]

    def _emit_call(self, call: ToolCall) -> dict[str, Any]:
        self.calls.append(call)
        return {"tool_calls": [call.to_delta(len(self.calls) - 1)]}
