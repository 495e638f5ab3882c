"""OpenAI Responses requests (`POST /v1/responses`), translated into the chat completions request
model; the chat path's error names renamed to the Responses fields.

A Responses body becomes the chat completions body the chat path already parses (`translate`,
then openai_schema.parse_chat): `instructions` a system message, message items chat messages
(input_text / output_text parts as text parts), `function_call` items assistant `tool_calls`,
`function_call_output` items `tool` messages, function tools OpenAI chat tools, `text.format`
the chat `response_format`, `max_output_tokens` max_tokens. So the prompt, the sampling and the
constrained tool call are those of chat completions, token for token. What the chat path does
not check (the item structure, the tool and part types this server cannot serve) is checked here,
each error naming the Responses field.

The output goes the other way, in responses_output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skippy_zmq.api.openai_schema import RequestError, renamed

RESPONSES_ENDPOINT = "/v1/responses"
# Sampling and serving extensions passed to the chat request as they are (llama-server and vLLM take
# them on this endpoint too): `seed` makes a sampled answer reproducible.
EXTENSIONS = ("temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "ignore_eos", "prompt_cache_key", "speculative", "parallel_tool_calls")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
              "assistant": ("output_text", "refusal")}
DROPPED_ITEMS = ("reasoning",)   # a past turn's reasoning is not rendered again (as chat completions)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Request fields whose meaning this server cannot honour: refused, not silently dropped.
REFUSED = {"background": "background responses are not supported",
           "conversation": "conversations are not supported; send the items, or use previous_response_id",
           "prompt": "prompt templates are not supported; send instructions and input"}


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(path: str, problem: str) -> RequestError:
    return RequestError(f"{path}: {problem}", re.split(r"[.\[]", path, maxsplit=1)[0])


# What the chat path names differently (a message starts with the path it is about).
_RENAMES = ((re.compile(r"^tools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
            (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
            (re.compile(r"^max_tokens"), "max_output_tokens"),
            (re.compile(r"^messages"), "input"),
            (re.compile(r"^chat_template_kwargs"), "reasoning"),
            (re.compile(r"^response_format(\.json_schema)?"), "text.format"))


def responses_names(err: RequestError) -> RequestError:
    """The chat path's error with the Responses field names."""
    out = renamed(err, _RENAMES)
    if out.param in ("max_tokens", "response_format"):   # errors whose message does not start with the field
        out.param = {"max_tokens": "max_output_tokens", "response_format": "text"}[out.param]
    return out


@dataclass(frozen=True)
class Translated:
    """A Responses request as a chat body, and its conversation (history plus this input, without
    the instructions, which a later response does not inherit) to keep for previous_response_id."""

    chat: dict[str, Any]
    conversation: list[dict[str, Any]]


def translate(body: Mapping[str, Any], history: Sequence[dict[str, Any]] = ()) -> Translated:
    """The chat completions body of a /v1/responses body; `history`: the conversation of the
    previous response (previous_response_id), before this input."""
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False):
            raise _fail(name, why)
    chat: dict[str, Any] = {key: body[key] for key in EXTENSIONS if body.get(key) is not None}
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _fail("model", f"must be a string, got {_short(body['model'])}")
    for name in ("stream", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _fail(name, f"must be a boolean, got {_short(body[name])}")
    chat["stream"] = bool(body.get("stream"))
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise _fail("max_output_tokens", f"must be an integer >= 1, got {_short(limit)}")
        chat["max_tokens"] = limit
    if body.get("top_logprobs"):
        raise _fail("top_logprobs", "logprobs are not supported on /v1/responses; use /v1/chat/completions")
    conversation = [*history, *_input(body.get("input"), _open_calls(history))]
    chat["messages"] = _instructions(body.get("instructions")) + conversation
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    chat.update(_text_format(body.get("text")))
    chat.update(_reasoning(body.get("reasoning")))
    return Translated(chat, conversation)


def _instructions(raw: object) -> list[dict[str, Any]]:
    if raw is None or raw == "":
        return []
    if not isinstance(raw, str):
        raise _fail("instructions", f"must be a string, got {_short(raw)}")
    return [{"role": "system", "content": raw}]


def _open_calls(history: Sequence[dict[str, Any]]) -> set[str]:
    """The call ids a function_call_output may answer first: those of the history's last turn."""
    if history and history[-1].get("tool_calls"):
        return {call["id"] for call in history[-1]["tool_calls"]}
    return set()


# ---------------------------------------------------------------- input items

def _input(raw: object, open_ids: set[str]) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _fail("input", f"must be a string or a non-empty list of items, got {_short(raw)}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise _fail(path, f"must be an object, got {_short(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, path))
            open_ids = set()
        elif kind == "function_call":
            call = _function_call(item, path)
            if out and out[-1]["role"] == "assistant":   # the calls of one turn (after its text) go together
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            open_ids = {c["id"] for c in out[-1]["tool_calls"]}
        elif kind == "function_call_output":
            out.append(_call_output(item, path, open_ids))
        elif kind not in DROPPED_ITEMS:
            raise _fail(f"{path}.type", f"{_short(kind)} items are not supported (allowed: message, "
                        "function_call, function_call_output, reasoning)")
    return out


def _message(item: dict, path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise _fail(f"{path}.role", f"must be one of {', '.join(ROLES)}, got {_short(role)}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise _fail(f"{path}.content", f"must be a string or a list of content parts, got {_short(content)}")
    return {"role": role, "content": [_text_part(part, f"{path}.content[{j}]", TEXT_PARTS[role])
                                      for j, part in enumerate(content)]}


def _text_part(part: object, path: str, allowed: tuple[str, ...]) -> dict[str, str]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in allowed:
        raise _fail(f"{path}.type", f"{_short(kind)} parts are not supported here (allowed: {', '.join(allowed)}; "
                    "this server reads text only)")
    field = "refusal" if kind == "refusal" else "text"
    if not isinstance(part.get(field), str):
        raise _fail(f"{path}.{field}", f"must be a string, got {_short(part.get(field))}")
    return {"type": "text", "text": part[field]}


def _function_call(item: dict, path: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise _fail(f"{path}.{key}", f"must be a {'non-empty ' if key != 'arguments' else ''}string, "
                        f"got {_short(item.get(key))}")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}


def _call_output(item: dict, path: str, open_ids: set[str]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if call_id not in open_ids:
        known = ", ".join(sorted(open_ids)) or "none"
        raise _fail(f"{path}.call_id", f"{_short(call_id)} answers no function_call item of the turn "
                    f"before it (its call ids: {known})")
    output = item.get("output")
    if isinstance(output, list):
        output = "\n".join(_text_part(p, f"{path}.output[{j}]", ("input_text", "output_text"))["text"]
                           for j, p in enumerate(output))
    if not isinstance(output, str):
        raise _fail(f"{path}.output", f"must be a string or a list of input_text parts, got {_short(output)}")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


# ---------------------------------------------------------------- tools, text, reasoning

def _tools(raw: object) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _fail("tools", f"must be a list of tools, got {_short(raw)}")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise _fail(f"tools[{i}]", f"must be an object, got {_short(tool)}")
        if tool.get("type") != "function":
            raise _fail(f"tools[{i}].type", f"{_short(tool.get('type'))} tools are not supported; "
                        "only function tools (type, name, description, parameters, strict)")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: object) -> str | dict[str, Any]:
    if raw in ("auto", "required", "none"):
        return str(raw)
    if isinstance(raw, dict) and raw.get("type") == "function":
        if not isinstance(raw.get("name"), str):
            raise _fail("tool_choice.name", f"must be a string, got {_short(raw.get('name'))}")
        return {"type": "function", "function": {"name": raw["name"]}}
    raise _fail("tool_choice", f'must be "auto", "required", "none" or {{"type": "function", "name": ...}}, '
                f"got {_short(raw)}")


def _text_format(raw: object) -> dict[str, Any]:
    """`text.format` as the chat response_format, so the grammar engine constrains the text as it
    does for chat completions; `text.verbosity` is accepted."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail("text", f"must be an object, got {_short(raw)}")
    fmt = raw.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _fail("text.format", 'must be {"type": "text"}, {"type": "json_object"} or '
                    f'{{"type": "json_schema", "name": ..., "schema": {{...}}}}, got {_short(fmt)}')
    spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def _reasoning(raw: object) -> dict[str, Any]:
    """`reasoning.effort` is accepted; "none" turns reasoning off in templates that switch it
    (Qwen3's enable_thinking); the other efforts leave the template's default."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail("reasoning", f"must be an object, got {_short(raw)}")
    effort = raw.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _fail("reasoning.effort", f"must be one of {', '.join(EFFORTS)}, got {_short(effort)}")
    return {"chat_template_kwargs": {"enable_thinking": False}} if effort == "none" else {}
