"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: the OpenAI Responses API as a thin
adapter over the chat completions path (the same request model, prompt, engine and output split).

A request is translated into a chat completions body (responses_schema.translate) and parsed,
checked, rendered and submitted exactly as chat completions does; one TextStream reads the
engine, one ChatOutput splits its text into reasoning, content and tool calls, and
responses_output.OutputItems turns that into output items and `response.*` stream events.
Errors are the chat path's (OpenAI's shape, raised to the app's handlers), named by the
Responses fields. Finished responses with `store` (the API's default) go into a bounded
ResponseStore, which GET /v1/responses/{id} reads and previous_response_id continues.

The respond flow (wait for the first events, stream or collect, a 499 for a client gone) is
streaming.respond's, as for every API shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from loguru import logger

from skippy_zmq.api import responses_schema as schema
from skippy_zmq.api.context import ServerContext, engine_status, keeps_special
from skippy_zmq.text.chat_output import ChatOutput
from skippy_zmq.engine.request import EngineError, GenRequest
from skippy_zmq.engine.metrics import error_kind
from skippy_zmq.api.openai_schema import ParsedRequest, RequestError, check_constraint, error_body, parse_chat, read_body, to_gen_request
from skippy_zmq.api.prompt_encoding import encode_prompt
from skippy_zmq.text.reasoning import prompt_opens_thinking
from skippy_zmq.api.request_prep import parse_body, validate_request
from skippy_zmq.api.responses_output import Envelope, OutputItems, ResponseStore, output_messages, usage
from skippy_zmq.api.streaming import Reply, respond
from skippy_zmq.api.text_stream import TextStream


def install_routes(app: FastAPI, ctx: ServerContext) -> None:
    store = ResponseStore()   # one per app: what this server answered, bounded

    @app.post(schema.RESPONSES_ENDPOINT)
    async def create_response(request: Request) -> Response:
        return await _create(ctx, store, request)

    @app.get(schema.RESPONSES_ENDPOINT + "/{response_id}")
    async def get_response(response_id: str) -> Response:
        entry = store.get(response_id)
        return JSONResponse(entry.response) if entry is not None else _not_found(ctx, response_id)

    @app.delete(schema.RESPONSES_ENDPOINT + "/{response_id}")
    async def delete_response(response_id: str) -> Response:
        if not store.delete(response_id):
            return _not_found(ctx, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(ctx: ServerContext, response_id: str) -> JSONResponse:
    ctx.metrics.count_error(error_kind(404))
    return JSONResponse(error_body(f"Response with id {response_id!r} not found.", 404, "response_id"), 404)


@dataclass
class Generation:
    """One /v1/responses generation: the engine's text stream, its split into items, and the
    count of the tokens that went to reasoning."""

    parsed: ParsedRequest
    stream: TextStream
    output: ChatOutput
    envelope: Envelope
    conversation: list[dict[str, Any]]
    items: OutputItems = field(default_factory=OutputItems)
    reasoning_tokens: int = 0

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The item events as the text streams; the tokens of a text that made only reasoning
        (its tags included) are reasoning tokens."""
        counted = 0
        async for text in self.stream.deltas():
            deltas = self.output.push(text)
            if deltas and all("reasoning_content" in d for d in deltas):
                self.reasoning_tokens += self.stream.completion_tokens - counted
            if deltas:
                counted = self.stream.completion_tokens
            for delta in deltas:
                for event in self.items.push(delta):
                    yield event
        for delta in self.output.flush():
            for event in self.items.push(delta):
                yield event
        for event in self.items.close(self.status):
            yield event

    @property
    def status(self) -> str:
        return "incomplete" if self.stream.finish_reason == "length" else "completed"

    def final(self) -> dict[str, Any]:
        stream = self.stream
        counts = usage(len(stream.request.prompt_ids), stream.completion_tokens, stream.cached_tokens,
                       self.reasoning_tokens)
        return self.envelope.response(self.status, self.items.output, counts)


def _history(body: dict[str, Any], store: ResponseStore) -> list[dict[str, Any]]:
    """The stored conversation `previous_response_id` continues (on the loop: the store is the loop's)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    entry = store.get(previous) if isinstance(previous, str) else None
    if entry is None:
        raise RequestError(f"Previous response with id {previous!r} not found.", "previous_response_id",
                           404, "previous_response_not_found")
    return entry.conversation


def _parse(ctx: ServerContext, body: dict[str, Any], history: list[dict[str, Any]]) -> tuple[ParsedRequest, list]:
    """Translate and check a body under the chat path's caps (in a worker: ctx.work)."""
    translated = schema.translate(body, history)
    try:
        return validate_request(ctx.prep_context(), translated.chat, parse_chat), translated.conversation
    except RequestError as err:
        raise schema.responses_names(err) from None


def _encode(ctx: ServerContext, parsed: ParsedRequest, request_id: str) -> tuple[list[int], GenRequest]:
    """The constraint compiled, the prompt rendered and tokenised (in a worker: ctx.work)."""
    try:
        if parsed.constraint is not None:   # a schema or a forced call: it compiles now, or it is a 400
            check_constraint(parsed, ctx.constraint_info())
        ids = encode_prompt(ctx.tokenizer, parsed, None, ctx.engine.max_context)
        return ids, to_gen_request(parsed, ids, request_id, ctx.engine.max_context)
    except RequestError as err:
        raise schema.responses_names(err) from None


async def _prepare(ctx: ServerContext, store: ResponseStore, request: Request) -> Generation:
    """Parse, check and submit the request as chat completions does; the answer not yet read."""
    body = await ctx.work.run(parse_body, await read_body(request, ctx.max_body_bytes))
    parsed, conversation = await ctx.work.run(_parse, ctx, body, _history(body, store))
    ctx.require_ready()
    ids, gen_request = await ctx.work.run(_encode, ctx, parsed, request.state.request_id)
    stream = TextStream(ctx, gen_request, (), request.state.arrival, keep_special=keeps_special(parsed))
    thinking_open = ctx.thinks and prompt_opens_thinking(ctx.tokenizer.decode(ids[-8:]))
    return Generation(parsed, stream, ctx.chat_output(parsed, thinking_open), Envelope.new(ctx.model_name, body),
                      conversation if body.get("store") is not False else [])


def _keep(store: ResponseStore, generation: Generation, response: dict[str, Any]) -> None:
    if response["store"]:
        history = generation.conversation + output_messages(response["output"])
        if not store.put(response, history):
            logger.warning("response {} not stored: over the store's {} bytes", response["id"], store.max_bytes)


async def _create(ctx: ServerContext, store: ResponseStore, request: Request) -> Response:
    generation = await _prepare(ctx, store, request)

    async def finish(response: dict[str, Any]) -> Response:
        _keep(store, generation, response)
        return JSONResponse(response)

    return await respond(ctx, request, Reply(
        start=generation.stream.start, events=lambda: _sse_events(ctx, store, generation),
        collect=lambda: _whole(generation), finish=finish, close=generation.stream.close),
        generation.parsed.options.stream)


async def _whole(generation: Generation) -> dict[str, Any]:
    async for _ in generation.events():
        pass
    return generation.final()


def _sse(event: dict[str, Any], sequence_number: int) -> bytes:
    data = json.dumps({**event, "sequence_number": sequence_number}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _sse_events(ctx: ServerContext, store: ResponseStore, generation: Generation) -> AsyncIterator[bytes]:
    """response.created, response.in_progress, each item's events, then response.completed (or
    response.incomplete); an engine failure after the headers went out is response.failed."""
    envelope, sequence = generation.envelope, 0

    def numbered(event: dict[str, Any]) -> bytes:
        nonlocal sequence
        sequence += 1
        return _sse(event, sequence - 1)

    try:
        opening = envelope.response("in_progress", [], None)
        yield numbered({"type": "response.created", "response": opening})
        yield numbered({"type": "response.in_progress", "response": opening})
        async for event in generation.events():
            yield numbered(event)
        response = generation.final()
        _keep(store, generation, response)
        yield numbered({"type": f"response.{response['status']}", "response": response})
    except Exception as err:   # the headers are gone: response.failed, as the API sends one
        if isinstance(err, EngineError):
            status, code, message = engine_status(err), err.code, err.message
            logger.warning("engine error mid-stream {} ({}): {}", status, code, message)
        else:
            status, code, message = 500, "server_error", "internal server error"
            logger.exception("stream failed")
        ctx.metrics.count_error(error_kind(status))
        failed = envelope.response("failed", generation.items.output, None,
                                   error={"code": code or "server_error", "message": message})
        yield numbered({"type": "response.failed", "response": failed})
    finally:
        await generation.stream.close()
