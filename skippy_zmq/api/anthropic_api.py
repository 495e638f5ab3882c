"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic Messages API as a thin
adapter over the chat completions path (the same request model, prompt, engine and output split).

A request is translated into a chat completions body (anthropic_schema.to_chat_body) and parsed,
checked, rendered and submitted exactly as chat completions does; one TextStream reads the
engine, one ChatOutput splits its text into reasoning, content and tool calls, and
anthropic_blocks.ContentBlocks turns that into Anthropic's content blocks and stream events.
Errors on these routes are in Anthropic's shape.

The respond flow (wait for the first events, stream or collect, a 499 for a client gone) is
streaming.respond's, as for every API shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from loguru import logger

from skippy_zmq.api import anthropic_schema as schema
from skippy_zmq.api.anthropic_blocks import ContentBlocks, matched_stop, message, new_message_id, stop_reason, usage
from skippy_zmq.text.chat_output import ChatOutput
from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent
from skippy_zmq.engine.metrics import error_kind
from skippy_zmq.api.openai_schema import ParsedRequest, RequestError, check_constraint, parse_chat, read_body, to_gen_request
from skippy_zmq.api.prompt_encoding import encode_prompt
from skippy_zmq.text.reasoning import prompt_opens_thinking
from skippy_zmq.api.context import ServerContext, engine_status, keeps_special, retry_headers
from skippy_zmq.api.request_prep import parse_body, validate_request
from skippy_zmq.api.streaming import Reply, respond
from skippy_zmq.api.text_stream import TextStream


def install_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post(schema.MESSAGES_ENDPOINT)
    async def messages(request: Request) -> Response:
        return await _answer(ctx, request, lambda: _create_message(ctx, request))

    @app.post(schema.COUNT_TOKENS_ENDPOINT)
    async def count_tokens(request: Request) -> Response:
        return await _answer(ctx, request, lambda: _count_tokens(ctx, request))


# ---------------------------------------------------------------- errors

def error_response(ctx: ServerContext, request: Request, status: int, text: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    ctx.metrics.count_error(error_kind(status))
    body = schema.error_body(status, text, request.state.request_id)
    return JSONResponse(body, status_code=status, headers=headers)


async def _answer(ctx: ServerContext, request: Request, handle: Callable[[], Awaitable[Response]]) -> Response:
    """The handler's response, or its RequestError / EngineError in Anthropic's error shape."""
    try:
        return await handle()
    except RequestError as err:
        return error_response(ctx, request, err.status, err.message)
    except EngineError as err:
        status = engine_status(err)
        logger.warning("engine error {} ({}): {}", status, err.code, err.message)
        return error_response(ctx, request, status, err.message, retry_headers(err))


def _parse(ctx: ServerContext, raw: bytes, count_only: bool = False) -> ParsedRequest:
    """Parse, translate and check a body under the chat path's caps (in a worker: ctx.work)."""
    chat = schema.to_chat_body(parse_body(raw), count_only=count_only)
    try:
        return validate_request(ctx.prep_context(), chat, parse_chat)
    except RequestError as err:
        raise schema.anthropic_names(err) from None


async def _parsed(ctx: ServerContext, request: Request, count_only: bool = False) -> ParsedRequest:
    return await ctx.work.run(_parse, ctx, await read_body(request, ctx.max_body_bytes), count_only)


async def _encode(ctx: ServerContext, parsed: ParsedRequest) -> list[int]:
    return await ctx.work.run(encode_prompt, ctx.tokenizer, parsed, None, ctx.engine.max_context)


# ---------------------------------------------------------------- count_tokens

async def _count_tokens(ctx: ServerContext, request: Request) -> Response:
    """The rendered prompt's length (tools and system included), as /v1/messages would submit it."""
    parsed = await _parsed(ctx, request, count_only=True)
    ids = await _encode(ctx, parsed)
    return JSONResponse({"input_tokens": len(ids)})


# ---------------------------------------------------------------- messages

async def _recording(events: AsyncIterator[TokenEvent], into: list[int]) -> AsyncIterator[TokenEvent]:
    """The engine's events, each token id also kept in `into` (to tell which stop sequence hit);
    closing this closes the engine's iterator, which cancels the request."""
    try:
        async for event in events:
            if event.token_id is not None:
                into.append(event.token_id)
            yield event
    finally:
        await events.aclose()


@dataclass
class Answer:
    """One /v1/messages generation: the engine's text stream, its split into blocks, and what
    the usage and stop reason need."""

    ctx: ServerContext
    parsed: ParsedRequest
    stream: TextStream
    output: ChatOutput
    tokens: list[int]     # the token ids the stream consumed
    keep_special: bool
    emitted: str = ""     # the text the stream gave, stop sequences cut

    async def deltas(self) -> AsyncIterator[dict[str, Any]]:
        """ChatOutput's deltas (content, reasoning_content, tool_calls) as the text streams."""
        async for text in self.stream.deltas():
            self.emitted += text
            for delta in self.output.push(text):
                yield delta
        for delta in self.output.flush():
            yield delta

    def stop_sequence(self) -> str | None:
        stops = self.parsed.options.stop
        if self.stream.finish_reason != "stop" or not stops:
            return None
        decoder = self.ctx.tokenizer.stream_decoder(skip_special=not self.keep_special)
        raw = "".join(decoder.push(t) for t in self.tokens) + decoder.flush()
        return matched_stop(raw, self.emitted, stops)

    def final(self) -> tuple[str, str | None, dict[str, int]]:
        """(stop_reason, stop_sequence, usage) once the text is done."""
        sequence = self.stop_sequence()
        reason = stop_reason(self.stream.finish_reason, self.output.call_count, sequence)
        counts = usage(len(self.stream.request.prompt_ids), self.stream.completion_tokens, self.stream.cached_tokens)
        return reason, None if reason != "stop_sequence" else sequence, counts


async def _prepare(ctx: ServerContext, request: Request) -> Answer:
    """Parse, check and submit the request as chat completions does; the answer not yet read."""
    parsed = await _parsed(ctx, request)
    ctx.require_ready()
    if parsed.constraint is not None:   # a forced tool call: its schema compiles now, or it is a 400
        try:
            await ctx.work.run(lambda: check_constraint(parsed, ctx.constraint_info()))
        except RequestError as err:
            raise schema.anthropic_names(err) from None
    ids = await _encode(ctx, parsed)
    try:
        gen_request: GenRequest = to_gen_request(parsed, ids, request.state.request_id, ctx.engine.max_context)
    except RequestError as err:
        if err.code != "context_length_exceeded":
            raise
        # The API's own wording: clients (Claude Code) read it to know the conversation must be compacted.
        raise RequestError(f"prompt is too long: {len(ids)} tokens > {ctx.engine.max_context - 1} maximum",
                           "messages", code=err.code) from None
    tokens: list[int] = []
    keep_special = keeps_special(parsed)
    stream = TextStream(ctx, gen_request, parsed.options.stop, request.state.arrival,
                        events=_recording(ctx.engine.generate(gen_request), tokens), keep_special=keep_special)
    thinking_open = ctx.thinks and prompt_opens_thinking(ctx.tokenizer.decode(ids[-8:]))
    return Answer(ctx, parsed, stream, ctx.chat_output(parsed, thinking_open), tokens, keep_special)


async def _create_message(ctx: ServerContext, request: Request) -> Response:
    answer = await _prepare(ctx, request)

    async def finish(body: dict[str, Any]) -> Response:
        return JSONResponse(body)

    return await respond(ctx, request, Reply(
        start=answer.stream.start, events=lambda: _sse_events(ctx, request, answer),
        collect=lambda: _whole_message(ctx, answer), finish=finish, close=answer.stream.close),
        answer.parsed.options.stream)


async def _whole_message(ctx: ServerContext, answer: Answer) -> dict[str, Any]:
    """The non-streamed message: the stream's events folded into content blocks."""
    blocks = ContentBlocks()
    async for delta in answer.deltas():
        blocks.push(delta)
    blocks.close()
    reason, sequence, counts = answer.final()
    return message(new_message_id(), ctx.model_name, blocks.content, reason, sequence, counts)


def _sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _sse_events(ctx: ServerContext, request: Request, answer: Answer) -> AsyncIterator[bytes]:
    """message_start, a ping, each block's start / deltas / stop, message_delta, message_stop; an
    engine failure after the headers went out is an `error` event, as the API sends one."""
    stream, blocks = answer.stream, ContentBlocks()
    opening = usage(len(stream.request.prompt_ids), 0, stream.cached_tokens)
    try:
        yield _sse({"type": "message_start", "message": message(
            new_message_id(), ctx.model_name, [], None, None, opening)})
        yield _sse({"type": "ping"})
        async for delta in answer.deltas():
            for event in blocks.push(delta):
                yield _sse(event)
        for event in blocks.close():
            yield _sse(event)
        reason, sequence, counts = answer.final()
        yield _sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": counts})
        yield _sse({"type": "message_stop"})
    except EngineError as err:   # the headers are gone: an `error` event, as the API sends one
        status = engine_status(err)
        logger.warning("engine error mid-stream {} ({}): {}", status, err.code, err.message)
        ctx.metrics.count_error(error_kind(status))
        yield _sse(schema.error_body(status, err.message, request.state.request_id))
    except Exception:
        logger.exception("stream failed")
        ctx.metrics.count_error(error_kind(500))
        yield _sse(schema.error_body(500, "internal server error", request.state.request_id))
    finally:
        await stream.close()
