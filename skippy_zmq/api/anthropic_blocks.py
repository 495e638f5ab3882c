"""Anthropic Messages output: what a chat completion's output becomes on /v1/messages.

ChatOutput's deltas (content, reasoning_content, tool_calls) become content blocks and
Anthropic's stream events (`ContentBlocks`): text, thinking (closed by an empty signature, as
nothing here signs reasoning) and tool_use blocks with `toolu_` ids; the non-streamed message
is the blocks those same events make, so the two always agree. The finish reason becomes
stop_reason, and usage counts cache reads apart from input_tokens, as the API does.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def stop_reason(finish_reason: str | None, calls: int, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason of a chat finish_reason ("stop" / "length")."""
    if finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: input_tokens counts only what was not read from the cache."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def message(message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
            stop_sequence: str | None, counts: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence, "usage": counts}


_OPENINGS = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}


class ContentBlocks:
    """ChatOutput deltas in, Anthropic content block events out (content_block_start / _delta /
    _stop, indices from 0); `content` is the blocks those events make."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None   # the type of the block open now

    def push(self, delta: Mapping[str, Any]) -> list[dict[str, Any]]:
        if delta.get("reasoning_content"):
            return self._into("thinking") + [self._delta({"type": "thinking_delta",
                                                           "thinking": delta["reasoning_content"]})]
        if delta.get("content"):
            return self._into("text") + [self._delta({"type": "text_delta", "text": delta["content"]})]
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            events += self._close()
            events += [self._start({"type": "tool_use", "id": new_tool_use_id(), "name": function["name"],
                                    "input": {}}),
                       self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})]
            events += self._close()
        return events

    def close(self) -> list[dict[str, Any]]:
        """The events that end the content: the open block closed (an empty text block first when
        the answer made none, so every message has a block to read, as llama-server does)."""
        return self._close() if self.content else [self._start(dict(_OPENINGS["text"]))] + self._close()

    def _into(self, kind: str) -> list[dict[str, Any]]:
        if self._open == kind:
            return []
        return self._close() + [self._start(dict(_OPENINGS[kind]))]

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self._open = block["type"]
        self.content.append({**block, "input": {}} if block["type"] == "tool_use" else dict(block))
        return {"type": "content_block_start", "index": len(self.content) - 1, "content_block": block}

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        block = self.content[-1]
        if delta["type"] == "input_json_delta":
            block["input"] = json.loads(delta["partial_json"] or "{}")
        else:
            field = "text" if delta["type"] == "text_delta" else "thinking"
            block[field] += delta[field]
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, kind, self._open = len(self.content) - 1, self._open, None
        # A thinking block ends with its signature (empty: nothing here signs reasoning), as the API's do.
        signature = [{"type": "content_block_delta", "index": index,
                      "delta": {"type": "signature_delta", "signature": ""}}] if kind == "thinking" else []
        return signature + [{"type": "content_block_stop", "index": index}]


def matched_stop(raw_text: str, emitted: str, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended an output: the shortest one the raw text has right where the
    emitted text stops (the one that completed first), or None (it ended some other way)."""
    rest = raw_text[len(emitted):] if raw_text.startswith(emitted) else ""
    found = [stop for stop in stops if rest.startswith(stop)]
    return min(found, key=len) if found else None
