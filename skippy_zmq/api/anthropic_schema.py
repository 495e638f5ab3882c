"""Anthropic Messages requests, translated into the chat completions request model; errors.

A `/v1/messages` body becomes the chat completions body the OpenAI path already parses
(`to_chat_body`, then openai_schema.parse_chat): the system prompt becomes a system message,
`tool_use` blocks assistant `tool_calls`, `tool_result` blocks `tool` messages, `tools` OpenAI
function tools and `tool_choice` auto / any / tool / none the chat choices auto / required /
named / none. So the prompt, the sampling and the constrained tool call are those of chat
completions, token for token. Only what the chat path does not check (the block structure) is
validated here, each error naming the Anthropic field; the few errors the chat path raises name
its own fields and are renamed (`anthropic_names`).

The output goes the other way, in anthropic_blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from skippy_zmq.api.openai_schema import MAX_STOP_STRINGS, RequestError, renamed

MESSAGES_ENDPOINT = "/v1/messages"
COUNT_TOKENS_ENDPOINT = "/v1/messages/count_tokens"
# Sampling and serving extensions passed to the chat request as they are (llama-server and vLLM
# take them on this endpoint too): `seed` makes a sampled answer reproducible.
EXTENSIONS = ("top_k", "top_p", "temperature", "seed", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "ignore_eos", "prompt_cache_key", "speculative")
DROPPED_BLOCKS = ("thinking", "redacted_thinking")   # a past turn's reasoning is not rendered again
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}   # plus {"type": "tool", "name"}
THINKING_TYPES = ("enabled", "disabled", "adaptive")


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(path: str, problem: str) -> RequestError:
    return RequestError(f"{path}: {problem}", re.split(r"[.\[]", path, maxsplit=1)[0])


# ---------------------------------------------------------------- errors

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


# What the chat path names differently (a message starts with the path it is about).
_RENAMES = ((re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
            (re.compile(r"^tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
            (re.compile(r"^tools\[(\d+)\]\.function\.description"), r"tools[\1].description"),
            (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
            (re.compile(r"^parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"),
            (re.compile(r"^stop\b"), "stop_sequences"),
            (re.compile(r"^chat_template_kwargs"), "thinking"),
            (re.compile(r"^response_format(\.json_schema)?"), "output_config.format"))


def anthropic_names(err: RequestError) -> RequestError:
    """The chat path's error with the Anthropic field names."""
    return renamed(err, _RENAMES)


# ---------------------------------------------------------------- request

def to_chat_body(body: Mapping[str, Any], *, count_only: bool = False) -> dict[str, Any]:
    """The chat completions body of a /v1/messages body (count_only: of a count_tokens body,
    which has no max_tokens)."""
    chat: dict[str, Any] = {key: body[key] for key in EXTENSIONS if body.get(key) is not None}
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _fail("model", f"must be a string, got {_short(body['model'])}")
    if not count_only:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise _fail("max_tokens", "Field required")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _fail("max_tokens", f"must be an integer >= 1, got {_short(max_tokens)}")
        chat["max_tokens"] = max_tokens
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise _fail("stream", f"must be a boolean, got {_short(stream)}")
        chat["stream"] = bool(stream)
        chat["stop"] = _stop_sequences(body.get("stop_sequences"))
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    chat.update(_tool_choice(body.get("tool_choice"), bool(tools)))
    chat.update(_output_format(body.get("output_config")))
    enable = _thinking(body.get("thinking"))
    if enable is not None:   # templates that switch reasoning (Qwen3) read enable_thinking; others ignore it
        chat["chat_template_kwargs"] = {"enable_thinking": enable}
    return chat


def _stop_sequences(raw: object) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise _fail("stop_sequences", f"must be a list of strings, got {_short(raw)}")
    if len(raw) > MAX_STOP_STRINGS:
        raise _fail("stop_sequences", f"at most {MAX_STOP_STRINGS} stop sequences, got {len(raw)}")
    return raw


def _text_block(block: object, path: str) -> dict[str, str]:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else block
        raise _fail(path, f"only text blocks are supported here, got {_short(kind)}")
    if not isinstance(block.get("text"), str):
        raise _fail(f"{path}.text", f"must be a string, got {_short(block.get('text'))}")
    return {"type": "text", "text": block["text"]}


def _text_parts(raw: object, path: str) -> list[dict[str, str]]:
    """A string or a list of text blocks, as chat text parts (the chat path joins them)."""
    if isinstance(raw, str):
        return [{"type": "text", "text": raw}]
    if not isinstance(raw, list):
        raise _fail(path, f"must be a string or a list of text blocks, got {_short(raw)}")
    return [_text_block(block, f"{path}[{j}]") for j, block in enumerate(raw)]


def _system(raw: object) -> list[dict[str, Any]]:
    if raw is None or raw == "" or raw == []:
        return []
    return [{"role": "system", "content": _text_parts(raw, "system")}]


def _messages(raw: object) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise _fail("messages", f"must be a non-empty list of messages, got {_short(raw)}")
    out: list[dict[str, Any]] = []
    open_ids: set[str] = set()   # the tool_use ids of the assistant turn before this one
    for i, message in enumerate(raw):
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _fail(path, f"must be an object, got {_short(message)}")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _fail(f"{path}.role", f'must be "user" or "assistant", got {_short(role)}')
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _fail(f"{path}.content", f"must be a string or a list of content blocks, got {_short(content)}")
        if role == "assistant":
            turn, open_ids = _assistant_turn(blocks, f"{path}.content")
            out.append(turn)
        else:
            out += _user_turn(blocks, f"{path}.content", open_ids)
            open_ids = set()
    if raw[-1].get("role") == "assistant":
        raise _fail(f"messages[{len(raw) - 1}].role", "a final assistant message (prefill) is not supported; "
                    "end with a user message")
    return out


def _block_type(block: object, path: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise _fail(path, f"must be a content block with a type, got {_short(block)}")
    if kind not in allowed:
        raise _fail(f"{path}.type", f"{kind!r} blocks are not supported here (allowed: {', '.join(allowed)})")
    return kind


def _assistant_turn(blocks: list, path: str) -> tuple[dict[str, Any], set[str]]:
    parts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{path}[{j}]", ("text", "tool_use", *DROPPED_BLOCKS))
        if kind == "text":
            parts.append(_text_block(block, f"{path}[{j}]"))
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{path}[{j}]"))
    ids = [c["id"] for c in calls]
    if len(set(ids)) != len(ids):
        raise _fail(path, f"tool_use ids must be unique, got {ids}")
    if not calls:
        return {"role": "assistant", "content": parts}, set()
    return {"role": "assistant", "content": parts or None, "tool_calls": calls}, set(ids)


def _tool_use(block: dict, path: str) -> dict[str, Any]:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise _fail(f"{path}.{key}", f"must be a non-empty string, got {_short(block.get(key))}")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise _fail(f"{path}.input", f"must be an object, got {_short(arguments)}")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _user_turn(blocks: list, path: str, open_ids: set[str]) -> list[dict[str, Any]]:
    """Tool results first (as `tool` messages, answering the assistant turn before), then the
    user's text, whatever order the blocks came in (as llama-server does)."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{path}[{j}]", ("text", "tool_result"))
        if kind == "text":
            parts.append(_text_block(block, f"{path}[{j}]"))
            continue
        call_id = block.get("tool_use_id")
        if call_id not in open_ids:
            known = ", ".join(sorted(open_ids)) or "none"
            raise _fail(f"{path}[{j}].tool_use_id", f"{_short(call_id)} answers no tool_use block of the "
                        f"assistant message before it (its tool_use ids: {known})")
        text = "\n".join(p["text"] for p in _text_parts(block.get("content", ""), f"{path}[{j}].content"))
        if block.get("is_error"):
            text = f"Error: {text}"
        results.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if not parts and not results:
        raise _fail(path, "must hold at least one text or tool_result block")
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _tools(raw: object) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _fail("tools", f"must be a list of tools, got {_short(raw)}")
    out = []
    for i, tool in enumerate(raw):
        path = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _fail(path, f"must be an object, got {_short(tool)}")
        if tool.get("type") not in (None, "custom"):
            raise _fail(f"{path}.type", f"only client tools (name, description, input_schema) are supported, "
                        f"not {_short(tool.get('type'))}")
        if "input_schema" not in tool:
            raise _fail(f"{path}.input_schema", "Field required")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: object, has_tools: bool) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or (raw.get("type") not in TOOL_CHOICES and raw.get("type") != "tool"):
        raise _fail("tool_choice", f'must be {{"type": "auto" | "any" | "tool" | "none"}}, got {_short(raw)}')
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _fail("tool_choice.disable_parallel_tool_use", f"must be a boolean, got {_short(disable)}")
    if raw["type"] in ("any", "tool") and not has_tools:
        raise _fail("tool_choice.type", f"{raw['type']!r} needs at least one tool in tools")
    chat: dict[str, Any] = {"parallel_tool_calls": False} if disable else {}
    if raw["type"] == "tool":
        if not isinstance(raw.get("name"), str):
            raise _fail("tool_choice.name", f"must be a string, got {_short(raw.get('name'))}")
        chat["tool_choice"] = {"type": "function", "function": {"name": raw["name"]}}
    elif has_tools or raw["type"] == "none":
        chat["tool_choice"] = TOOL_CHOICES[raw["type"]]
    return chat


def _output_format(raw: object) -> dict[str, Any]:
    """Structured output (`output_config.format` json_schema) as the chat response_format, so the
    grammar engine constrains the text as it does for chat completions; `effort` is accepted."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail("output_config", f"must be an object, got {_short(raw)}")
    fmt = raw.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _fail("output_config.format", f'must be {{"type": "json_schema", "schema": {{...}}}}, got {_short(fmt)}')
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def _thinking(raw: object) -> bool | None:
    """Whether the request turns reasoning on or off (None: the template's default). A budget is
    accepted and not enforced: max_tokens bounds the whole answer."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("type") not in THINKING_TYPES:
        raise _fail("thinking", f'must be {{"type": "enabled" | "disabled" | "adaptive"}}, got {_short(raw)}')
    budget = raw.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise _fail("thinking.budget_tokens", f"must be an integer >= 1, got {_short(budget)}")
    return None if raw["type"] == "adaptive" else raw["type"] == "enabled"
