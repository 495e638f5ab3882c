"""OpenAI wire format: body and parameter validation, prompt encoding, response builders, stop strings.

Requests are plain JSON dicts checked by small tables (type, unsupported
values) so every rejection names the offending parameter in the OpenAI error
body, as vLLM and llama-server do. Unknown keys are ignored (like vLLM).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError
from starlette.requests import Request

from skippy_zmq.driver.engine import GenRequest
from skippy_zmq.model.tokenizer import TextTokenizer
from skippy_zmq.sampling import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
MAX_STOP_STRINGS = 4
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when the client sends none


class RequestError(Exception):
    """A request the server refuses; rendered as an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_exceeded"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


# ---------------------------------------------------------------- validation

def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# name -> (check, what it must be). Checked only when the value is not null.
_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a boolean"),
    "prompt_cache_key": (lambda v: isinstance(v, str), "a string"),
    "speculative": (lambda v: isinstance(v, bool), "a boolean"),
    "max_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "max_completion_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "stop": (lambda v: isinstance(v, (str, list)), "a string or a list of strings"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object mapping token ids to numbers"),
    "top_k": (_is_int, "an integer"),
}


def _tool_choice_off(value: object) -> bool:
    return value in (None, "none")


# name -> (accepted(value), why it is refused). Checked on every request.
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v in (None, 1), "only n=1 is supported"),
    "logprobs": (lambda v: v in (None, False), "logprobs are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported"),
    "tools": (lambda v: not v, "tool calling is not supported"),
    "tool_choice": (_tool_choice_off, "tool calling is not supported"),
    "functions": (lambda v: not v, "function calling is not supported"),
    "function_call": (_tool_choice_off, "function calling is not supported"),
    "response_format": (lambda v: v in (None, {"type": "text"}), 'only {"type": "text"} is supported'),
    "echo": (lambda v: not v, "echo is not supported"),
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
    "suffix": (lambda v: v in (None, ""), "suffix is not supported"),
}

_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed",
)


def check_fields(body: Mapping[str, Any]) -> None:
    """Types of the scalar fields, then parameters this server does not support."""
    for name, (ok, what) in _TYPES.items():
        value = body.get(name)
        if value is not None and not ok(value):
            raise RequestError(f"{name} must be {what}, got {_short(value)}", name)
    for name, (accepted, why) in _UNSUPPORTED.items():
        if not accepted(body.get(name)):
            raise RequestError(f"{name}: {why}", name)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_logit_bias(raw: Mapping[str, Any] | None) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias keys must be token ids, got {_short(key)}", "logit_bias") from None
        if not _is_number(value) or not math.isfinite(value):
            raise RequestError(f"logit_bias values must be finite numbers, got {_short(value)}", "logit_bias")
        bias[token] = float(value)
    return bias


def parse_sampling(body: Mapping[str, Any], vocab_size: int) -> SamplingParams:
    """SamplingParams from the body; its ValueError names the parameter first."""
    kwargs = {key: body[key] for key in _SAMPLING_KEYS if body.get(key) is not None}
    kwargs.setdefault("temperature", DEFAULT_TEMPERATURE)
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # vLLM's spelling of "disabled"
    try:
        params = SamplingParams(logit_bias=parse_logit_bias(body.get("logit_bias")), **kwargs)
        params.validate(vocab_size)
    except ValueError as err:
        name = str(err).split(" ", 1)[0].rstrip(":")
        raise RequestError(str(err), name if name in (*_SAMPLING_KEYS, "logit_bias") else None) from None
    return params


def parse_stop(raw: object) -> tuple[str, ...]:
    stops = [raw] if isinstance(raw, str) else list(raw or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    if not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", "stop")
    return tuple(dict.fromkeys(s for s in stops if s))  # empty strings would match at once


@dataclass(frozen=True)
class GenOptions:
    """What a request asks of generation, independent of chat/completions."""

    sampling: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_key: str | None
    speculative: bool | None = None   # extension: false opts this request out of drafting


def parse_options(body: Mapping[str, Any], vocab_size: int) -> GenOptions:
    check_fields(body)
    stream = bool(body.get("stream"))
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise RequestError("stream_options: only allowed when stream is true", "stream_options")
    include_usage = (stream_options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options")
    return GenOptions(
        sampling=parse_sampling(body, vocab_size),
        max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
        stop=parse_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=bool(body.get("ignore_eos")),
        cache_key=body.get("prompt_cache_key"),
        speculative=body.get("speculative"),
    )


@dataclass(frozen=True)
class ParsedRequest:
    """A validated chat or completions request; exactly one of messages/prompt is set."""

    format: ResponseFormat
    options: GenOptions
    messages: tuple[dict[str, str], ...] = ()
    prompt: str | tuple[int, ...] | None = None


def _message_text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "\n".join(part["text"] for part in content)  # vLLM joins text parts the same way
    raise RequestError(
        f'messages[{index}].content must be a string or a list of {{"type": "text", "text": ...}} parts',
        "messages",
    )


def parse_messages(raw: object) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", "messages")
    messages = []
    for index, message in enumerate(raw):
        role = message.get("role") if isinstance(message, dict) else None
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            raise RequestError(
                f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, got {_short(role)}", "messages"
            )
        messages.append({"role": role, "content": _message_text(message.get("content"), index)})
    return tuple(messages)


def parse_prompt(raw: object, vocab_size: int) -> str | tuple[int, ...]:
    """One prompt: a string, a list of token ids, or a one-element list of either."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        bad = next((t for t in raw if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
        return tuple(raw)
    if isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, (str, list)) for p in raw):
        raise RequestError("prompt: only one prompt per request is supported", "prompt")
    raise RequestError("prompt must be a string or a non-empty list of token ids", "prompt")


def parse_chat(body: Mapping[str, Any], vocab_size: int) -> ParsedRequest:
    messages = parse_messages(body.get("messages"))
    return ParsedRequest(CHAT, parse_options(body, vocab_size), messages=messages)


def parse_completion(body: Mapping[str, Any], vocab_size: int) -> ParsedRequest:
    prompt = parse_prompt(body.get("prompt"), vocab_size)
    return ParsedRequest(COMPLETION, parse_options(body, vocab_size), prompt=prompt)


# ---------------------------------------------------------------- body and prompt

async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object body, refusing other media types and anything over `limit` bytes."""
    media_type = (request.headers.get("content-type") or "application/json").split(";")[0].strip().lower()
    if not media_type.endswith("json"):
        raise RequestError(f"Content-Type must be application/json, got {media_type!r}", status=415)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body is {declared} bytes; the limit is {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a chunked body has no Content-Length to check up front
            raise RequestError(f"request body exceeds the limit of {limit} bytes", status=413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError:
        raise RequestError("malformed JSON body: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def encode_prompt(tokenizer: TextTokenizer, parsed: ParsedRequest) -> list[int]:
    if parsed.messages:
        try:
            return tokenizer.encode_chat(list(parsed.messages))
        except (TemplateError, ValueError, TypeError) as err:  # e.g. raise_exception() on role order
            raise RequestError(f"messages: the chat template failed: {err}", "messages") from None
    if isinstance(parsed.prompt, str):
        try:
            return tokenizer.encode(parsed.prompt)
        except (TypeError, ValueError) as err:   # e.g. a lone surrogate the tokenizer cannot take
            raise RequestError(f"prompt cannot be tokenized: {err}", "prompt") from None
    return list(parsed.prompt or ())


def to_gen_request(parsed: ParsedRequest, prompt_ids: list[int], request_id: str, max_context: int) -> GenRequest:
    """The engine request; max_tokens defaults to, and is clamped to, the room left in the context."""
    param, room = parsed.format.prompt_param, max_context - len(prompt_ids)
    if not prompt_ids:
        raise RequestError(f"{param}: the prompt is empty", param)
    if room <= 0:
        raise RequestError(
            f"{param}: the prompt has {len(prompt_ids)} tokens but this model's maximum context length "
            f"is {max_context} tokens", param, code="context_length_exceeded",
        )
    options = parsed.options
    return GenRequest(
        request_id=request_id, prompt_ids=tuple(prompt_ids), sampling=options.sampling,
        max_tokens=min(options.max_tokens or room, room), ignore_eos=options.ignore_eos,
        cache_key=options.cache_key, speculative=options.speculative,
    )


# ---------------------------------------------------------------- responses

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class ResponseFormat:
    """How one endpoint shapes its objects; CHAT and COMPLETION below."""

    endpoint: str
    prompt_param: str
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def envelope(self, response_id: str, created: int, model: str, choices: list, chunk: bool) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": self.chunk_object if chunk else self.object,
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """The single choice of a non-streamed response."""
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None = None, opening: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, str] = {"role": "assistant", "content": text} if opening else {}
        if text and not opening:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


CHAT = ResponseFormat(
    "/v1/chat/completions", "messages", "chatcmpl", "chat.completion", "chat.completion.chunk", chat=True
)
COMPLETION = ResponseFormat(
    "/v1/completions", "prompt", "cmpl", "text_completion", "text_completion", chat=False
)


# ---------------------------------------------------------------- stop strings

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
        keep = self._held_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held text, once no more text will come."""
        text, self._held = self._held, ""
        return text

    def _held_length(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
