"""`POST /v1/chat/completions` and `POST /v1/completions`: OpenAI's two generation endpoints.

A request is parsed, rendered and tokenised off the event loop (request_prep, in ctx.work), each
prompt submitted once with its n choices sharing the prefill (ChoiceFanOut), and every choice's
TextStream read into `choices[]`: streamed as chunks merged across choices as they come, or whole.
Chat calls and reasoning are split from the content by ChatOutput when tools or thinking are on.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from loguru import logger

from skippy_zmq.api.context import ServerContext, engine_error_response, error_response, keeps_special
from skippy_zmq.api.offloop import dumps_in_parts
from skippy_zmq.api.openai_responses import CHAT, COMPLETION, TextOffsets, usage
from skippy_zmq.api.openai_schema import ParsedRequest, parse_chat, parse_completion, read_body
from skippy_zmq.api.request_prep import Parser, parse_request, prepare_prompts
from skippy_zmq.api.streaming import Reply, respond
from skippy_zmq.api.text_stream import ChoiceFanOut, TextStream
from skippy_zmq.engine.request import ChoiceControl, EngineError
from skippy_zmq.text import tools
from skippy_zmq.text.chat_output import ChatOutput, message_fields


def install_routes(app: FastAPI) -> None:
    @app.post(CHAT.endpoint)
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, parse_chat)

    @app.post(COMPLETION.endpoint)
    async def completions(request: Request) -> Response:
        return await _generate(request, parse_completion)


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


@dataclass
class Choice:
    """One choice of a response: its stream, its index and (completions echo) the prompt text."""

    index: int
    stream: TextStream
    echo: str | None = None
    first: bool = True   # the first choice of its prompt: usage counts that prompt here
    thinking_open: bool = False   # chat: the prompt ends inside <think> (the output starts as reasoning)

    def output(self, ctx: ServerContext, parsed: ParsedRequest) -> ChatOutput:
        """How this chat choice's text becomes reasoning, content and tool calls."""
        return ctx.chat_output(parsed, self.thinking_open)


async def _choice_chunks(ctx: ServerContext, choice: Choice, parsed: ParsedRequest) -> AsyncIterator[dict[str, Any]]:
    """One choice's streamed `choices[]` entries, in order."""
    fmt, stream, echo = parsed.format, choice.stream, choice.echo
    offsets = TextOffsets()   # completions' text_offset, carried from chunk to chunk

    def logprobs() -> dict[str, Any] | None:
        """The logprobs of the tokens behind the delta about to go out (None when off or none)."""
        entries = stream.take_logprobs()
        return fmt.logprobs(ctx.tokenizer, entries, offsets) if entries else None

    def indexed(body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "index": choice.index}

    if fmt.chat:
        yield indexed(fmt.chunk_choice("", opening=True))
    if echo is not None:   # completions echo: the prompt (and its tokens' logprobs, built off the loop) first
        scored = await ctx.work.run(fmt.logprobs, ctx.tokenizer, stream.prompt_logprobs(), offsets) \
            if parsed.options.logprobs is not None else None
        yield indexed(fmt.chunk_choice(echo, logprobs=scored))
    if fmt.chat and (parsed.toolset.active or ctx.thinks):
        # Calls go out whole, one delta.tool_calls each, once complete; reasoning as
        # reasoning_content deltas; the rest as content deltas (ChatOutput).
        output = choice.output(ctx, parsed)
        async for text in stream.deltas():
            for delta in output.push(text):   # a text's logprobs go with the first delta it makes
                yield indexed(fmt.delta_choice(delta, logprobs=logprobs()))
        for delta in output.flush():
            yield indexed(fmt.delta_choice(delta, logprobs=logprobs()))
        yield indexed(fmt.chunk_choice("", tools.finish_reason(stream.finish_reason, output.call_count),
                                       logprobs=logprobs()))
    else:
        async for text in stream.deltas():
            yield indexed(fmt.chunk_choice(text, logprobs=logprobs()))
        yield indexed(fmt.chunk_choice("", stream.finish_reason, logprobs=logprobs()))


async def _merged(parts: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[dict[str, Any]]:
    """Items of several iterators as they come (one iterator: just that one)."""
    if len(parts) == 1:
        async for item in parts[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(part: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for item in part:
                queue.put_nowait(item)
        except Exception as err:
            queue.put_nowait(err)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(drain(part)) for part in parts]
    try:
        open_parts = len(parts)
        while open_parts:
            item = await queue.get()
            if item is done:
                open_parts -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(choices: list[Choice]) -> dict[str, Any]:
    """Each prompt counted once (its first choice), every choice's completion tokens."""
    firsts = [c.stream for c in choices if c.first]
    return usage(sum(len(s.request.prompt_ids) for s in firsts), sum(c.stream.completion_tokens for c in choices),
                 sum(s.cached_tokens for s in firsts))


async def sse_events(ctx: ServerContext, choices: list[Choice], parsed: ParsedRequest,
                     close: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    fmt, include_usage = parsed.format, parsed.options.include_usage
    response_id, created = f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time())

    def chunk(entries: list[dict[str, Any]]) -> bytes:
        body = fmt.envelope(response_id, created, ctx.model_name, entries, chunk=True)
        return _sse({**body, "usage": None} if include_usage else body)

    try:
        async for entry in _merged([_choice_chunks(ctx, c, parsed) for c in choices]):
            # an echoed prompt's logprobs can be big: serialised in a worker
            yield await ctx.work.run(chunk, [entry]) if _long_logprobs(entry) else chunk([entry])
        if include_usage:
            yield _sse({**fmt.envelope(response_id, created, ctx.model_name, [], chunk=True), "usage": _usage(choices)})
    except EngineError as err:  # headers are gone: report in-band, as OpenAI and vLLM do
        yield _sse(json.loads(engine_error_response(ctx, err).body))
    except Exception:
        logger.exception("stream failed")
        yield _sse(json.loads(error_response(ctx, 500, "internal server error").body))
    finally:
        await close()
    yield _sse("[DONE]")


def _long_logprobs(entry: dict[str, Any]) -> bool:
    scored = entry.get("logprobs") or {}
    return len(scored.get("tokens") or scored.get("content") or ()) > 64


async def _generate(request: Request, parse: Parser) -> Response:
    """The event loop moves bytes; parsing, rendering, tokenising and assembling run in ctx.work."""
    ctx: ServerContext = request.app.state.ctx
    prep = ctx.prep_context()
    parsed = await ctx.work.run(parse_request, prep, await read_body(request, ctx.max_body_bytes), parse)
    ctx.require_ready()
    prompts = await ctx.work.run(prepare_prompts, prep, parsed, request.state.request_id)
    n = parsed.options.n
    fans: list[ChoiceFanOut] = []
    choices: list[Choice] = []
    for prompt in prompts:   # n choices of a prompt share its prefill (GenRequest.n)
        control = ChoiceControl()
        fan = ChoiceFanOut(ctx.engine.generate(prompt.gen_request, control), n, control) if n > 1 else None
        fans += [fan] if fan is not None else []
        for c in range(n):
            events = fan.choice(c) if fan is not None else None
            stream = TextStream(ctx, prompt.gen_request, parsed.options.stop, request.state.arrival,
                                parsed.options.echo_only, events=events, keep_special=keeps_special(parsed))
            choices.append(Choice(len(choices), stream, prompt.echo, first=c == 0,
                                  thinking_open=prompt.thinking_open))

    async def close() -> None:
        for c in choices:
            await c.stream.close()
        for fan in fans:
            await fan.aclose()

    async def finish(texts: list[str]) -> Response:
        body = await ctx.work.run(lambda: dumps_in_parts(_full_response(ctx, parsed, choices, list(texts))))
        return Response(body, media_type="application/json")

    return await respond(ctx, request, Reply(
        start=lambda: asyncio.gather(*(c.stream.start() for c in choices)),
        events=lambda: sse_events(ctx, choices, parsed, close),
        collect=lambda: asyncio.gather(*(c.stream.collect() for c in choices)),
        finish=finish, close=close), parsed.options.stream)

def _full_response(ctx: ServerContext, parsed: ParsedRequest, choices: list[Choice],
                   texts: list[str]) -> dict[str, Any]:
    fmt = parsed.format
    out = []
    for choice, text in zip(choices, texts):
        stream, echo = choice.stream, choice.echo
        logprobs = None
        if parsed.options.logprobs is not None:
            scored = stream.prompt_logprobs() if echo is not None else []
            logprobs = fmt.logprobs(ctx.tokenizer, scored + stream.take_logprobs())
        if echo is not None:
            text = echo + text
        if fmt.chat and (parsed.toolset.active or ctx.thinks):   # calls and reasoning apart from content
            output = choice.output(ctx, parsed)
            content, reasoning, calls = message_fields(output.push(text) + output.flush())
            body = fmt.choice(content, tools.finish_reason(stream.finish_reason, calls), calls, logprobs=logprobs)
            if reasoning is not None:
                body["message"]["reasoning_content"] = reasoning
        else:
            body = fmt.choice(text, stream.finish_reason, logprobs=logprobs)
        out.append({**body, "index": choice.index})
    body = fmt.envelope(f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time()), ctx.model_name, out, chunk=False)
    body["usage"] = _usage(choices)
    return body

