"""A request's CPU work before it reaches the engine, run in a worker thread (driver.offloop).

Two steps, so a request that parses is told 503 while the model loads before anything costly:
`parse_request` (JSON, caps, field and tool-schema validation) and `prepare_prompts` (the
constraint compiled, the template rendered, the prompts tokenised, the response's size checked).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from loguru import logger

from skippy_zmq.text import tools
from skippy_zmq.engine.request import GenRequest
from skippy_zmq.api.limits import RequestLimits, check_body, check_choices, check_extras, check_response, check_strings
from skippy_zmq.api.openai_schema import ParsedRequest, RequestError, check_constraint, for_model, parse_json_body, to_gen_request
from skippy_zmq.api.prompt_encoding import encode_prompt
from skippy_zmq.text.reasoning import prompt_opens_thinking
from skippy_zmq.text.tokenizer import TextTokenizer

Parser = Callable[[Mapping[str, Any], int], ParsedRequest]
# a small chat body the driver prepares once before it serves (warm_request_path)
WARM_CHAT = b'{"messages":[{"role":"user","content":"Hello."}],"max_tokens":1}'


@dataclass(frozen=True)
class PrepContext:
    """What preparing a request needs from the server."""

    tokenizer: TextTokenizer
    tool_format: tools.ToolFormat
    thinks: bool
    limits: RequestLimits
    constraint_info: Callable[[], Any]   # the grammar engine's tokenizer view, built on first use
    max_context: int


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt of a request, ready for the engine."""

    gen_request: GenRequest
    echo: str | None = None       # completions echo: the prompt as sent (token ids: decoded)
    thinking_open: bool = False   # chat: the prompt ends inside <think>


def check_template_name(parsed: ParsedRequest, tokenizer: TextTokenizer) -> None:
    """chat_template_kwargs.chat_template may only name one of the model's templates: a request
    cannot bring its own Jinja (the templates belong to the model)."""
    if "chat_template" not in parsed.template_kwargs:
        return
    name, names = parsed.template_kwargs["chat_template"], tokenizer.chat_template_names()
    if isinstance(name, str) and name in names:
        return
    what = "template text is not accepted" if isinstance(name, str) and ("{" in name or "%" in name) \
        else f"{name!r:.60} is not one of them"
    raise RequestError(f"chat_template_kwargs.chat_template: names one of this model's chat templates "
                       f"({', '.join(names) or 'none'}); {what}", "chat_template_kwargs")


def parse_request(prep: PrepContext, raw: bytes, parse: Parser) -> ParsedRequest:
    """The body parsed and validated, every cap on its fields checked first."""
    return validate_request(prep, parse_body(raw), parse)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a body, its strings checked (no lone surrogates)."""
    body = parse_json_body(raw)
    check_strings(raw, body)
    return body


def validate_request(prep: PrepContext, body: Mapping[str, Any], parse: Parser) -> ParsedRequest:
    """A chat or completions body (another API's, once translated) checked against the caps, then parsed."""
    check_body(body, prep.limits)
    parsed = for_model(parse(body, prep.tokenizer.vocab_size), prep.tool_format)
    check_template_name(parsed, prep.tokenizer)
    check_choices(parsed, prep.limits)
    check_extras(parsed, prep.limits)
    return parsed


def prepare_prompts(prep: PrepContext, parsed: ParsedRequest, request_id: str) -> list[PreparedPrompt]:
    """Every prompt rendered, tokenised and checked before any is submitted."""
    tokenizer = prep.tokenizer
    if parsed.constraint is not None:   # compile it now: a bad schema or grammar is a 400 naming its parameter
        check_constraint(parsed, prep.constraint_info())
    prompts = parsed.prompts or (parsed.prompt,)
    out = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, parsed, prompt, prep.max_context)
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if parsed.options.echo else None
        thinking = prep.thinks and prompt_opens_thinking(tokenizer.decode(ids[-8:]))
        out.append(PreparedPrompt(to_gen_request(parsed, ids, rid, prep.max_context), echo, thinking))
    check_response(parsed, [p.gen_request for p in out], [p.echo for p in out], prep.limits)
    return out


def warm_request_path(prep: PrepContext, parse: Parser) -> None:
    """Parse, render and tokenise WARM_CHAT once and drop it: what a first request did lazily (the
    template's first render, the tokenizer's first encode, the vocabulary's longest piece for the
    prompt-size check: ~0.05-0.1 CPU s, measured) is done while the stages start, not in front of it.
    A template that refuses it (one that wants a system turn first) only leaves that work to the first request."""
    try:
        prepare_prompts(prep, parse_request(prep, WARM_CHAT, parse), "warm-up")
    except Exception as exc:   # a warm-up: whatever went wrong, a real request meets and reports it
        logger.debug("request path not warmed: {}", exc)
