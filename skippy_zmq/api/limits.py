"""Caps on what one HTTP request may ask for, each refused with a 400 naming the cap.

Checked in a worker thread before the work they bound (schema validation, template rendering,
tokenisation, response assembly), so an oversized request costs little and never reaches the
pipeline. Values follow OpenAI's documented limits where it has them (128 tools, n <= 128, 4 stop
strings) and what a stage takes otherwise: a request's sampling settings and constraint travel to
the final stage in one message's JSON extras (wire.WireLimits.max_extras_bytes), so a request whose
settings would not fit is refused here rather than by the stage mid-request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skippy_zmq.engine.request import GenRequest
from skippy_zmq.api.openai_schema import ParsedRequest, RequestError
from skippy_zmq.protocol.wire import WireLimits

# A JSON body can only carry a lone surrogate as a \ud800-\udfff escape: look for one before walking.
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


@dataclass(frozen=True)
class RequestLimits:
    max_tools: int = 128                   # OpenAI's cap
    max_tools_bytes: int = 128 * 1024      # the tools list as JSON (validating 128 KB of properties: ~1.4 s CPU)
    max_messages: int = 2048
    max_content_parts: int = 256           # per message
    max_n: int = 128                       # OpenAI's cap (the engine may allow fewer: its lanes)
    max_choices: int = 256                 # prompts x n in one response
    max_stop_chars: int = 256              # per stop string (the matcher holds back up to this much text)
    max_logit_bias: int = 1024             # entries
    max_cache_key_chars: int = 256
    max_template_kwargs_bytes: int = 64 * 1024   # chat_template_kwargs as JSON
    max_template_kwargs_depth: int = 32          # its nesting (templates walk it recursively)
    max_logprob_entries: int = 512 * 1024  # (echoed prompt + max_tokens) x choices x (1 + top alternatives)
    max_echo_chars: int = 8 * 1024 * 1024  # echoed prompt text over all choices
    # what one message's extras may hold, less room for the keys the driver adds itself
    max_extras_bytes: int = WireLimits().max_extras_bytes - 1024


def _path(parts: Sequence[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts))


def check_strings(raw: bytes, body: Mapping[str, Any]) -> None:
    """Every string in the body is valid Unicode (a lone surrogate cannot be encoded or tokenised)."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, (*where, str(k))) for k, v in value.items())
            stack.extend((k, (*where, str(k))) for k in value if isinstance(k, str))
        elif isinstance(value, list):
            stack.extend((v, (*where, i)) for i, v in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                code = ord(value[err.start])
                raise RequestError(f"{_path(where)}: contains a lone surrogate (U+{code:04X}); strings must be "
                                   "valid Unicode", str(where[0]) if where else None) from None


def _over(param: str, what: str, count: int, cap: int) -> RequestError:
    return RequestError(f"{param}: {what} {count}; the limit is {cap}", param.split(".")[0].split("[")[0])


def _check_messages(messages: Any, limits: RequestLimits) -> None:
    if not isinstance(messages, list):
        return
    if len(messages) > limits.max_messages:
        raise _over("messages", "at most this many messages per request, got", len(messages), limits.max_messages)
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and len(content) > limits.max_content_parts:
            raise _over(f"messages[{i}].content", "content parts in one message:", len(content),
                        limits.max_content_parts)


def _check_tools(tools: Any, limits: RequestLimits) -> None:
    if not isinstance(tools, list):
        return
    if len(tools) > limits.max_tools:
        raise _over("tools", "at most this many tools per request, got", len(tools), limits.max_tools)
    size = 0
    for tool in tools:   # one tool at a time: no single long json.dumps holding the GIL
        size += len(json.dumps(tool, ensure_ascii=False).encode()) + 1
        if size > limits.max_tools_bytes:
            break
    if size > limits.max_tools_bytes:
        raise _over("tools", "the tools take at least this many bytes as JSON:", size, limits.max_tools_bytes)


def _check_generation_fields(body: Mapping[str, Any], limits: RequestLimits) -> None:
    n = body.get("n")
    if isinstance(n, int) and n > limits.max_n:
        raise _over("n", "at most this many choices per prompt, got", n, limits.max_n)
    stop = body.get("stop")
    for i, text in enumerate([stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []):
        if isinstance(text, str) and len(text) > limits.max_stop_chars:
            raise _over("stop", f"stop string {i} has this many characters:", len(text), limits.max_stop_chars)
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise _over("logit_bias", "entries:", len(bias), limits.max_logit_bias)
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and len(key) > limits.max_cache_key_chars:
        raise _over("prompt_cache_key", "characters:", len(key), limits.max_cache_key_chars)


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _check_template_kwargs(kwargs: Any, limits: RequestLimits) -> None:
    if not isinstance(kwargs, dict):
        return
    depth = _depth(kwargs)
    if depth > limits.max_template_kwargs_depth:
        raise _over("chat_template_kwargs", "nesting depth", depth, limits.max_template_kwargs_depth)
    size = len(json.dumps(kwargs, ensure_ascii=False).encode())
    if size > limits.max_template_kwargs_bytes:
        raise _over("chat_template_kwargs", "bytes as JSON:", size, limits.max_template_kwargs_bytes)


def check_body(body: Mapping[str, Any], limits: RequestLimits) -> None:
    """The counts and sizes of a request's fields, before anything is parsed or validated. Values
    of the wrong type are left to the parsers, which name them."""
    _check_messages(body.get("messages"), limits)
    _check_tools(body.get("tools"), limits)
    _check_template_kwargs(body.get("chat_template_kwargs"), limits)
    _check_generation_fields(body, limits)


def check_extras(parsed: ParsedRequest, limits: RequestLimits) -> None:
    """The sampling settings and constraint fit one pipeline message's extras."""
    extras = {"sampling": parsed.options.sampling.to_dict(), "logprobs": parsed.options.logprobs,
              "namespace": parsed.options.cache_key,
              "constraint": parsed.constraint.to_dict() if parsed.constraint is not None else None}
    size = len(json.dumps(extras, separators=(",", ":")).encode())
    if size > limits.max_extras_bytes:
        param = "logit_bias" if parsed.options.sampling.logit_bias else parsed.constraint_param or "logit_bias"
        raise RequestError(f"{param}: the request's sampling settings and constraint take {size} bytes in a "
                           f"pipeline message; the limit is {limits.max_extras_bytes}", param)


def check_choices(parsed: ParsedRequest, limits: RequestLimits) -> None:
    """prompts x n choices in one response, within its cap."""
    choices = len(parsed.prompts or (parsed.prompt,)) * parsed.options.n
    if choices > limits.max_choices:
        raise _over("n", "prompts x n is", choices, limits.max_choices)


def check_response(parsed: ParsedRequest, requests: Sequence[GenRequest], echoes: Sequence[str | None],
                   limits: RequestLimits) -> None:
    """What the response could hold: logprob entries and echoed text, within their caps."""
    n = parsed.options.n
    echo_chars = n * sum(len(e) for e in echoes if e is not None)
    if echo_chars > limits.max_echo_chars:
        raise _over("echo", "the echoed prompts (x n) take this many characters:", echo_chars, limits.max_echo_chars)
    if parsed.options.logprobs is None:
        return
    tokens = sum((len(r.prompt_ids) if parsed.options.echo else 0) + r.max_tokens for r in requests)
    entries = tokens * n * (1 + parsed.options.logprobs)
    if entries > limits.max_logprob_entries:
        raise RequestError(
            f"logprobs: this request could return {entries} logprob entries ((echoed prompt + max_tokens) x n x "
            f"(1 + logprobs)); the limit is {limits.max_logprob_entries}: lower max_tokens, n or logprobs",
            "logprobs")
