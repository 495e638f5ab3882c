"""OpenAI Responses output: what a chat completion's output becomes on /v1/responses.

ChatOutput's deltas (reasoning_content, content, tool_calls) become output items and the
`response.*` stream events (`OutputItems`): a `reasoning` item (reasoning_text content), a
`message` item (output_text content) and a `function_call` item per call; the non-streamed
response holds the items those same events make, so the two always agree. `response_object` is
the response envelope, `usage` its token counts; `ResponseStore` keeps finished responses (bounded)
for GET /v1/responses/{id} and previous_response_id.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    """The Responses usage: input_tokens counts the cached ones too (their share in the details)."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def echoed(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request's settings as the response object repeats them (the API's defaults when unset)."""
    reasoning = body.get("reasoning") or {}
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": body.get("store") is not False, "temperature": body.get("temperature", 1.0),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": body.get("truncation", "disabled"),
            "user": body.get("user"), "metadata": body.get("metadata") or {}}


@dataclass(frozen=True)
class Envelope:
    """What every snapshot of one response shares: its id, creation time, model and settings."""

    response_id: str
    model: str
    settings: dict[str, Any]
    created_at: int

    @classmethod
    def new(cls, model: str, body: Mapping[str, Any]) -> Envelope:
        return cls(new_id("resp"), model, echoed(body), int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], counts: dict[str, Any] | None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error, "incomplete_details": incomplete, "model": self.model,
                "output": output, **self.settings, "usage": counts}


_PARTS = {"message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
          "reasoning": {"type": "reasoning_text", "text": ""}}
_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


class OutputItems:
    """ChatOutput deltas in, `response.*` item events out (output_item.added, content_part.added,
    the text deltas, their done events, output_item.done; function_call_arguments for calls);
    `output` is the items those events make. Events carry no sequence_number: the writer numbers them."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self._open: str | None = None   # the type of the item open now

    def push(self, delta: Mapping[str, Any]) -> list[dict[str, Any]]:
        if delta.get("reasoning_content"):
            return self._into("reasoning") + [self._text_delta(delta["reasoning_content"])]
        if delta.get("content"):
            return self._into("message") + [self._text_delta(delta["content"])]
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls", ()):
            events += self._close("completed") + self._call(call["id"], call["function"])
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The events that end the output (`status`: "incomplete" for the item cut short); an empty
        message first when the answer made no item, so every response has one to read."""
        opening = [] if self.output else self._into("message")
        return opening + self._close(status)

    def _into(self, kind: str) -> list[dict[str, Any]]:
        if self._open == kind:
            return []
        events = self._close("completed")
        item: dict[str, Any] = {"id": new_id("msg" if kind == "message" else "rs"), "type": kind,
                                "status": "in_progress", "content": []}
        item.update({"role": "assistant"} if kind == "message" else {"summary": []})
        self.output.append(item)
        self._open = kind
        index, part = len(self.output) - 1, dict(_PARTS[kind])
        item["content"].append(part)
        return events + [{"type": "response.output_item.added", "output_index": index,
                          "item": {**item, "content": []}},
                         {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                          "content_index": 0, "part": dict(part)}]

    def _text_delta(self, text: str) -> dict[str, Any]:
        item = self.output[-1]
        item["content"][0]["text"] += text
        event = {"type": f"{_TEXT_EVENTS[item['type']]}.delta", "item_id": item["id"],
                 "output_index": len(self.output) - 1, "content_index": 0, "delta": text}
        return {**event, "logprobs": []} if item["type"] == "message" else event

    def _call(self, call_id: str, function: Mapping[str, str]) -> list[dict[str, Any]]:
        """A whole call (ChatOutput sends calls once complete): its arguments in one delta."""
        name, arguments = function["name"], function["arguments"]
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        index, where = len(self.output) - 1, {"item_id": item["id"], "output_index": len(self.output) - 1}
        added = {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
        item.update(arguments=arguments, status="completed")
        return [added, {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
                {"type": "response.function_call_arguments.done", **where, "name": name, "arguments": arguments},
                {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, item, self._open = len(self.output) - 1, self.output[-1], None
        item["status"] = status
        part, where = item["content"][0], {"item_id": item["id"], "output_index": len(self.output) - 1}
        done = {"type": f"{_TEXT_EVENTS[item['type']]}.done", **where, "content_index": 0, "text": part["text"]}
        return [{**done, "logprobs": []} if item["type"] == "message" else done,
                {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index, "item": json.loads(json.dumps(item))}]


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later turn renders (reasoning left out, as
    chat completions leaves a past turn's reasoning out)."""
    text = "".join(item["content"][0]["text"] for item in output if item["type"] == "message")
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not calls:
        return [{"role": "assistant", "content": text}]
    return [{"role": "assistant", "content": text or None, "tool_calls": calls}]


# ---------------------------------------------------------------- store

DEFAULT_STORE_RESPONSES = 256
DEFAULT_STORE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]             # what GET /v1/responses/{id} returns
    conversation: list[dict[str, Any]]   # chat messages, output included: what previous_response_id continues
    size: int


class ResponseStore:
    """Finished responses (store: true) by id, least recently used dropped first, at most
    `max_responses` of them and `max_bytes` of JSON in all: the server keeps no unbounded state.
    Used from the event loop only."""

    def __init__(self, max_responses: int = DEFAULT_STORE_RESPONSES, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep a response; False when it alone is over the byte cap (not kept)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = Stored(response, conversation, size)
        self._bytes += size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size
        return True

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry is not None
