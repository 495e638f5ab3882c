"""A parsed tool call, its id, and reading one from a decoded JSON object."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from skippy_zmq.text.tools.validation import ToolSet, dump


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str   # a JSON object, serialised

    def to_openai(self) -> dict[str, Any]:
        """As in `choices[].message.tool_calls[]`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_delta(self, index: int) -> dict[str, Any]:
        """As in `choices[].delta.tool_calls[]`: the whole call in one delta."""
        return {"index": index, **self.to_openai()}


def call_from_json(value: object, toolset: ToolSet | None, new_id: Callable[[], str]) -> ToolCall | None:
    """A call from a decoded {"name", "arguments"} object; None if it is not one (or not allowed)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "arguments" in value:
        arguments = value["arguments"]
    else:
        arguments = value.get("parameters", {})   # Llama 3.1's spelling
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    if toolset is not None and value["name"] not in {f.name for f in toolset.allowed}:
        return None   # a call to a function the request does not offer stays text
    return ToolCall(new_id(), value["name"], dump(arguments))


def finish_reason(reason: str | None, calls: list[ToolCall] | int) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the output made calls and stopped on its own."""
    count = calls if isinstance(calls, int) else len(calls)
    return "tool_calls" if count and reason == "stop" else reason
