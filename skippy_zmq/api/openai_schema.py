"""OpenAI wire format: body and parameter validation, prompt encoding (response builders and stop
strings: openai_responses, re-exported here).

Requests are plain JSON dicts checked by small tables (type, unsupported
values) so every rejection names the offending parameter in the OpenAI error
body, as vLLM and llama-server do. Unknown keys are ignored (like vLLM).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request

from skippy_zmq.text.constrain import ConstraintError, ConstraintSpec
from skippy_zmq.text import tools
from skippy_zmq.engine.request import GenRequest
from skippy_zmq.api.openai_responses import CHAT, COMPLETION, ResponseFormat, TextOffsets, TokenLogprob, usage
from skippy_zmq.text.reasoning import REASONING_FORMATS
from skippy_zmq.text.tokenizer import TextTokenizer
from skippy_zmq.sampling import SamplingParams

MAX_STOP_STRINGS = 4
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when the client sends none
# A constraint travels to the final stage in a message's JSON extras (64 KiB at most on the wire).
MAX_CONSTRAINT_BYTES = 48 * 1024


class RequestError(Exception):
    """A request the server refuses; rendered as an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def renamed(err: RequestError, renames: Sequence[tuple[re.Pattern[str], str]]) -> RequestError:
    """`err` with the chat path's field names replaced by another API's (a message starts with the
    path it is about; the param is that path's first name)."""
    message = err.message
    for pattern, name in renames:
        message = pattern.sub(name, message)
    param = re.split(r"[.\[:]", message, maxsplit=1)[0] if message != err.message else err.param
    return RequestError(message, param, err.status, err.code)


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
    "n": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "response_format": (lambda v: isinstance(v, dict), 'an object such as {"type": "json_object"}'),
}


def _tool_choice_off(value: object) -> bool:
    return value in (None, "none")


# name -> (accepted(value), why it is refused). Checked on every request.
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (lambda v: not v, "the deprecated functions parameter is not supported; use tools"),
    "function_call": (_tool_choice_off, "the deprecated function_call parameter is not supported; use tool_choice"),
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
    "suffix": (lambda v: v in (None, ""), "suffix is not supported"),
    # vLLM's per-request template text: here templates belong to the model (a name may be given in
    # chat_template_kwargs.chat_template)
    "chat_template": (lambda v: v is None, "a request cannot supply a chat template; the model's own render "
                                           "(name one of them with chat_template_kwargs.chat_template)"),
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
    logprobs: int | None = None       # None: off; N: each token's logprob plus the N most likely (0..20)
    echo: bool = False                # completions: the prompt comes first in the text (and logprobs)
    echo_only: bool = False           # echo with max_tokens 0: the prompt scored, nothing generated
    n: int = 1                        # choices per prompt: one prefill, n forked sessions


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
        n=body.get("n") or 1,
    )


@dataclass(frozen=True)
class ParsedRequest:
    """A validated chat or completions request; exactly one of messages/prompt is set.

    `constraint` is what the output must match (response_format, grammar, or the one tool call
    of a required / named tool_choice), `constraint_param` the parameter it came from (for
    errors); `toolset` the chat request's tools (NO_TOOLS otherwise), `tool_format` how the
    model writes calls (for_model sets it; the generic one until then); `template_kwargs` the
    request's chat_template_kwargs; `reasoning_format` "none" leaves <think> text in content."""

    format: ResponseFormat
    options: GenOptions
    messages: tuple[dict[str, Any], ...] = ()
    prompt: str | tuple[int, ...] | None = None
    prompts: tuple[str | tuple[int, ...], ...] = ()   # completions: every prompt of a batch (prompt = the first)
    constraint: ConstraintSpec | None = None
    constraint_param: str | None = None
    toolset: tools.ToolSet = tools.NO_TOOLS
    tool_format: tools.ToolFormat = tools.GENERIC
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_format: str = "auto"

    @property
    def output_prefix(self) -> str:
        """Text the prompt ends with that belongs to the answer (a constrained tool call's opening)."""
        return self.tool_format.constrained_prefix(self.toolset)


MAX_TOP_LOGPROBS = 20   # OpenAI: 20 for chat top_logprobs, 5 for completions logprobs (we take 20 for both)


def parse_chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs: true` turns them on, `top_logprobs: 0..20` asks for alternatives."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise RequestError(f"logprobs must be a boolean, got {_short(on)}", "logprobs")
    if top is not None and not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise RequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_short(top)}",
                           "top_logprobs")
    if top and not on:
        raise RequestError("top_logprobs: only allowed when logprobs is true", "top_logprobs")
    return (top or 0) if on else None


def parse_completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions: `logprobs: N` (0..20; OpenAI allows 5) turns them on with N alternatives."""
    n = body.get("logprobs")
    if n is None:
        return None
    if not (_is_int(n) and 0 <= n <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_short(n)}", "logprobs")
    return n


def parse_messages(raw: object) -> tuple[dict[str, Any], ...]:
    """Chat messages, tool traffic included (tools.normalise_messages: `tool` messages, assistant
    messages with `content: null` plus `tool_calls`)."""
    try:
        return tuple(tools.normalise_messages(raw))
    except tools.ToolError as err:
        raise RequestError(err.message, err.param) from None


def parse_toolset(body: Mapping[str, Any]) -> tools.ToolSet:
    try:
        return tools.validate_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except tools.ToolError as err:
        raise RequestError(err.message, err.param) from None


def parse_constraint(body: Mapping[str, Any]) -> tuple[ConstraintSpec | None, str | None]:
    """The constraint of `response_format` and the `grammar` extension, and which one it is."""
    try:
        spec = ConstraintSpec.from_openai(body.get("response_format"), body.get("grammar"))
    except ConstraintError as err:
        param = err.param or "response_format"
        raise RequestError(_named(param, str(err)), param) from None
    return spec, (spec.param if spec is not None else None)


def _named(param: str, message: str) -> str:
    """Error messages start with the parameter they are about."""
    return message if message.startswith(param) else f"{param}: {message}"


def _tool_constraint(toolset: tools.ToolSet, tool_format: tools.ToolFormat) -> ConstraintSpec | None:
    """What the one call a required / named tool_choice allows must match, written after the
    format's constrained prefix (which the prompt ends with)."""
    try:
        return tool_format.constraint(toolset)
    except ConstraintError as err:
        raise RequestError(_named("tools", str(err)), "tools") from None


# Names the server itself passes to the template; chat_template_kwargs may not replace them.
_TEMPLATE_OWN = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")


def parse_template_kwargs(raw: object) -> dict[str, Any]:
    """chat_template_kwargs (as llama-server and vLLM take them, e.g. {"enable_thinking": false})."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got {_short(raw)}", "chat_template_kwargs")
    for key in raw:
        if key in _TEMPLATE_OWN:
            raise RequestError(f"chat_template_kwargs.{key}: set by the server, not by the request",
                               "chat_template_kwargs")
    return dict(raw)


def parse_reasoning_format(raw: object) -> str:
    if raw is None:
        return "auto"
    if raw not in REASONING_FORMATS:
        raise RequestError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {_short(raw)}",
                           "reasoning_format")
    return str(raw)


def for_model(parsed: ParsedRequest, tool_format: tools.ToolFormat) -> ParsedRequest:
    """The request for a model whose template writes calls in `tool_format`: a forced call's
    constraint follows that format."""
    if not parsed.format.chat or tool_format is parsed.tool_format:
        return parsed
    if not parsed.toolset.constrained:
        return replace(parsed, tool_format=tool_format)
    return replace(parsed, tool_format=tool_format, constraint=_tool_constraint(parsed.toolset, tool_format))


MAX_PROMPTS = 64   # prompts in one batched completions request


def parse_prompts(raw: object, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    """Completions' prompt: a string, a list of token ids, or a list of either (a batch: one
    choice per prompt, as the OpenAI API does)."""
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        if len(raw) > MAX_PROMPTS:
            raise RequestError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(raw)}", "prompt")
        return tuple(parse_prompt(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(raw))
    return (parse_prompt(raw, vocab_size),)


def parse_prompt(raw: object, vocab_size: int, where: str = "prompt") -> str | tuple[int, ...]:
    """One prompt: a string or a non-empty list of token ids."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        bad = next((t for t in raw if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"{where} token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
        return tuple(raw)
    raise RequestError(f"{where} must be a string or a non-empty list of token ids", "prompt")


def parse_chat(body: Mapping[str, Any], vocab_size: int) -> ParsedRequest:
    messages = parse_messages(body.get("messages"))
    if body.get("echo"):
        raise RequestError("echo: only supported on /v1/completions", "echo")
    options = replace(parse_options(body, vocab_size), logprobs=parse_chat_logprobs(body))
    toolset = parse_toolset(body)
    constraint, param = parse_constraint(body)
    if constraint is not None and toolset.active:
        raise RequestError(f"{param}: cannot be combined with tools unless tool_choice is \"none\" "
                           f"(the output could not be both a tool call and the {param})", param)
    if toolset.constrained:
        constraint, param = _tool_constraint(toolset, tools.GENERIC), "tools"
    return ParsedRequest(CHAT, options, messages=messages, constraint=constraint, constraint_param=param,
                         toolset=toolset, template_kwargs=parse_template_kwargs(body.get("chat_template_kwargs")),
                         reasoning_format=parse_reasoning_format(body.get("reasoning_format")))


def parse_completion(body: Mapping[str, Any], vocab_size: int) -> ParsedRequest:
    prompts = parse_prompts(body.get("prompt"), vocab_size)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise RequestError(f"echo must be a boolean, got {_short(echo)}", "echo")
    # echo with max_tokens 0 (evaluation harnesses scoring a prompt): one token is generated and dropped
    echo_only = echo is True and body.get("max_tokens") == 0 and body.get("max_completion_tokens") is None
    if echo_only:
        body = {**body, "max_tokens": 1}
    options = replace(parse_options(body, vocab_size), logprobs=parse_completion_logprobs(body), echo=bool(echo),
                      echo_only=echo_only)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) not in (None, [], "none"):
            raise RequestError(f"{name}: tools are only supported on /v1/chat/completions", name)
    constraint, param = parse_constraint(body)
    return ParsedRequest(COMPLETION, options, prompt=prompts[0], prompts=prompts, constraint=constraint,
                         constraint_param=param)


def check_constraint(parsed: ParsedRequest, info: Any) -> None:
    """Compile the request's constraint for the model's tokenizer (constrain.validate), so a bad
    schema or grammar is a 400 naming its parameter here, not a failure mid-generation."""
    if parsed.constraint is None:
        return
    from skippy_zmq.text.constrain import validate

    param = parsed.constraint_param or parsed.constraint.param
    size = len(json.dumps(parsed.constraint.to_dict(), ensure_ascii=False).encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise RequestError(f"{param}: the constraint is {size} bytes as JSON; the limit is {MAX_CONSTRAINT_BYTES}",
                           param)
    try:
        validate(parsed.constraint, info)
    except ConstraintError as err:
        raise RequestError(_named(param, str(err)), param) from None


# ---------------------------------------------------------------- body and prompt

async def read_body(request: Request, limit: int) -> bytes:
    """The raw body of a JSON request, refusing other media types and anything over `limit` bytes
    (on the event loop: it only moves bytes; parse_json_body parses them in a worker)."""
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
    return b"".join(chunks)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in a request body."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("malformed JSON body: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


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
        cache_key=options.cache_key, speculative=options.speculative, logprobs=options.logprobs,
        prompt_logprobs=options.logprobs if options.echo else None,
        constraint=parsed.constraint.to_dict() if parsed.constraint is not None else None,
        n=options.n,
    )
