"""OpenAI-compatible HTTP server over an Engine (FastAPI + uvicorn).

The server turns requests into token ids (chat template / tokenizer), hands a
GenRequest to the engine, and turns the engine's TokenEvents back into text:
incremental detokenisation, stop strings across token boundaries, SSE
streaming. Closing the engine's iterator is how a request is cancelled (stop
string hit, client gone), so every path that stops reading closes it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from loguru import logger
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skippy_zmq.api import anthropic_api, console, embeddings_api, responses_api
from skippy_zmq.text import tools
from skippy_zmq.api.anthropic_schema import COUNT_TOKENS_ENDPOINT, MESSAGES_ENDPOINT
from skippy_zmq.api.responses_schema import RESPONSES_ENDPOINT
from skippy_zmq.text.chat_output import ChatOutput, message_fields
from skippy_zmq.text.stop_strings import StopMatcher
from skippy_zmq.engine.request import ChoiceControl, Engine, EngineError, GenRequest, TokenEvent
from skippy_zmq.config.http import EdgeConfig
from skippy_zmq.api.http_guard import ApiKeys, BodyTimeout, Guard, expects_body, header
from skippy_zmq.api.http_protocol import uvicorn_config
from skippy_zmq.api.limits import RequestLimits
from skippy_zmq.engine.metrics import ServerMetrics, error_kind
from skippy_zmq.api.offloop import OffLoop, dumps_in_parts
from skippy_zmq.api.openai_schema import CHAT, COMPLETION, ParsedRequest, RequestError, TextOffsets, TokenLogprob, error_body, parse_chat, parse_completion, read_body, usage
from skippy_zmq.text.reasoning import template_thinks
from skippy_zmq.api.request_prep import Parser, PrepContext, parse_request, prepare_prompts
from skippy_zmq.text.tokenizer import TextTokenizer

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
GENERATION_ENDPOINTS = (CHAT.endpoint, COMPLETION.endpoint, MESSAGES_ENDPOINT, RESPONSES_ENDPOINT,
                        embeddings_api.EMBEDDINGS_ENDPOINT)
KNOWN_ENDPOINTS = (*GENERATION_ENDPOINTS, COUNT_TOKENS_ENDPOINT, "/v1/models", "/health", "/readyz", "/metrics",
                   *console.ENDPOINTS)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
T = TypeVar("T")


@dataclass
class ServerContext:
    """Everything a handler needs; one per app, kept on app.state.ctx."""

    engine: Engine
    tokenizer: TextTokenizer
    model_name: str
    metrics: ServerMetrics
    api_key: str | None
    max_body_bytes: int
    created: int = field(default_factory=lambda: int(time.time()))
    tool_format: tools.ToolFormat = tools.GENERIC   # how the model writes tool calls (from its template)
    thinks: bool = False                            # the template writes <think>…</think>
    limits: RequestLimits = field(default_factory=RequestLimits)   # caps on what one request may ask
    work: OffLoop = field(default_factory=OffLoop)  # request parsing, rendering and assembly, off the loop
    _constraint_info: Any = None
    _constraint_lock: threading.Lock = field(default_factory=threading.Lock)

    def constraint_info(self) -> Any:
        """The grammar engine's view of the tokenizer (constrain.TokenizerInfo), built on first use,
        to check constraints before they reach the final stage (which builds its own)."""
        with self._constraint_lock:
            if self._constraint_info is None:
                from skippy_zmq.text.constrain import ConstraintError, TokenizerInfo

                try:
                    self._constraint_info = TokenizerInfo(self.tokenizer)
                except ConstraintError as err:
                    raise RequestError(f"response_format: structured output is not available: {err}",
                                       "response_format") from None
            return self._constraint_info

    def prep_context(self) -> PrepContext:
        return PrepContext(self.tokenizer, self.tool_format, self.thinks, self.limits, self.constraint_info,
                           self.engine.max_context)


class ClientDisconnected(Exception):
    """The client went away before a non-streamed answer was ready."""


# ---------------------------------------------------------------- errors

def error_response(ctx: ServerContext, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    ctx.metrics.count_error(error_kind(status))
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


def engine_error_response(ctx: ServerContext, err: EngineError) -> JSONResponse:
    status = err.status if 400 <= err.status <= 599 else 500
    headers = {"Retry-After": str(max(1, math.ceil(err.retry_after)))} if err.retry_after is not None else None
    logger.warning("engine error {} ({}): {}", status, err.code, err.message)
    return error_response(ctx, status, err.message, code=err.code, headers=headers)


def _install_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, err: RequestError) -> Response:
        return error_response(ctx, err.status, err.message, err.param, err.code)

    @app.exception_handler(EngineError)
    async def on_engine_error(_: Request, err: EngineError) -> Response:
        return engine_error_response(ctx, err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, err: StarletteHTTPException) -> Response:
        return error_response(ctx, err.status_code, str(err.detail), headers=err.headers)


# ---------------------------------------------------------------- middleware

class HttpMiddleware:
    """Request id, the edge's checks (http_guard), request metrics and last-resort 500s, as plain ASGI.

    Plain ASGI (not BaseHTTPMiddleware) so streamed responses and client
    disconnects pass through untouched.
    """

    def __init__(self, app: ASGIApp, ctx: ServerContext, guard: Guard) -> None:
        self.app, self.ctx, self.guard = app, ctx, guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = _request_id(scope)
        scope.setdefault("state", {}).update(request_id=request_id, arrival=time.perf_counter())
        endpoint = scope["path"] if scope["path"] in KNOWN_ENDPOINTS else "other"
        status: list[int] = []
        extra_headers = [(b"x-request-id", request_id.encode()), *self.guard.cors_headers(scope)]
        body = self.guard.body_deadline(receive)
        with_body = expects_body(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message["headers"] = [*message.get("headers", []), *extra_headers]
                if with_body and not body.complete:   # answered before its body was read (refused): close
                    message["headers"].append((b"connection", b"close"))
            await send(message)

        with logger.contextualize(request_id=request_id), self.ctx.metrics.in_flight(
            endpoint in GENERATION_ENDPOINTS
        ):
            try:
                await self._dispatch(scope, body, send_with_id)
            except ClientDisconnect:   # gone while we read its body: nobody to answer
                logger.info("client disconnected before its request body was read")
                self.ctx.metrics.count_error("client_disconnect")
                status.append(499)
            except BodyTimeout as err:   # a slow body: answer and close (the rest of it is never read)
                logger.info("{}", err)
                if not status:
                    await error_response(self.ctx, 408, str(err), code="body_timeout")(scope, receive, send_with_id)
            except Exception:
                logger.exception("unhandled error on {}", scope["path"])
                if not status:
                    await error_response(self.ctx, 500, "internal server error")(scope, receive, send_with_id)
            finally:
                seconds = time.perf_counter() - scope["state"]["arrival"]
                self.ctx.metrics.observe_request(endpoint, status[0] if status else 500, seconds)
                logger.debug("{} {} -> {} in {:.3f}s", scope["method"], scope["path"], status[:1], seconds)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.guard.admit(scope)
        preflight = self.guard.preflight(scope) if refusal is None else None
        if preflight is not None:   # CORS preflight from an allowed origin: before any key is asked for
            return await Response(status_code=204, headers=preflight)(scope, receive, send)
        refusal = refusal or self.guard.authorize(scope) or self.guard.media_type(scope)
        if refusal is not None:
            denied = error_response(self.ctx, refusal.status, refusal.message, code=refusal.code,
                                    headers=refusal.headers or None)
            return await denied(scope, receive, send)
        await self.app(scope, receive, send)


def _request_id(scope: Scope) -> str:
    given = (header(scope, b"x-request-id") or b"").decode("latin-1")
    return given if given and _REQUEST_ID_RE.fullmatch(given) else f"req-{uuid.uuid4().hex}"


# ---------------------------------------------------------------- generation

class ChoiceFanOut:
    """One engine request with n choices, split into one event iterator per choice.

    A single task reads the engine's iterator and routes each event by `TokenEvent.choice`; an
    error goes to every choice. `aclose` closes the engine's iterator, which cancels whatever has
    not finished.
    """

    def __init__(self, events: AsyncIterator[TokenEvent], n: int, control: ChoiceControl | None = None) -> None:
        self._events, self._queues = events, [asyncio.Queue() for _ in range(n)]
        self._task: asyncio.Task | None = None
        self._control = control   # a choice closed before its finish (a stop string) is cancelled alone

    async def _pump(self) -> None:
        try:
            async for event in self._events:
                self._queues[event.choice].put_nowait(event)
        except Exception as err:   # EngineError, or anything: every choice hears of it
            for queue in self._queues:
                queue.put_nowait(err)

    async def choice(self, index: int) -> AsyncIterator[TokenEvent]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._pump())
        ended = False
        try:
            while True:
                item = await self._queues[index].get()
                ended = isinstance(item, Exception) or item.finish_reason is not None
                if isinstance(item, Exception):
                    raise item
                yield item
                if ended:
                    return
        finally:
            if not ended and self._control is not None:
                self._control.cancel(index)   # this choice's job ends now, freeing its lane

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._events.aclose()


class TextStream:
    """One choice's engine events turned into text deltas, stop strings applied."""

    def __init__(self, ctx: ServerContext, request: GenRequest, stops: tuple[str, ...], arrival: float,
                 discard: bool = False, events: AsyncIterator[TokenEvent] | None = None,
                 keep_special: bool = False) -> None:
        """`keep_special`: special tokens stay in the text (a tool format's markers), all but the
        end-of-generation token that ends the request."""
        self.ctx, self.request = ctx, request
        self._keep_special = keep_special
        self._discard = discard   # echo with max_tokens 0: the token generated is dropped
        self.completion_tokens = self.cached_tokens = 0
        self.finish_reason: str | None = None
        self._events = events if events is not None else ctx.engine.generate(request)
        self._decoder = ctx.tokenizer.stream_decoder(skip_special=not keep_special)
        self._stops = StopMatcher(stops)
        self._first: TokenEvent | None = None
        self._last_time = arrival  # the first token's gap is the time to first token
        self._logprobs: list[TokenLogprob] = []   # tokens consumed since take_logprobs (request.logprobs set)

    async def start(self) -> None:
        """Wait for the first event, so engine errors still get a proper HTTP status."""
        try:
            self._first = await anext(self._events)
        except StopAsyncIteration:
            raise EngineError("engine ended the request without a finish reason", 500) from None
        self.cached_tokens = self._first.cached_tokens
        self.ctx.metrics.observe_prompt(len(self.request.prompt_ids), self.cached_tokens)

    async def deltas(self) -> AsyncIterator[str]:
        event = self._first
        while event is not None:
            text = self._consume(event)
            if text:
                yield text
            if self.finish_reason is not None:
                break
            event = await anext(self._events, None)
        if self.finish_reason is None:
            raise EngineError("engine ended the request without a finish reason", 500)
        await self.close()
        logger.info("finished ({}): {} prompt tokens ({} cached), {} generated", self.finish_reason,
                    len(self.request.prompt_ids), self.cached_tokens, self.completion_tokens)

    async def collect(self) -> str:
        return "".join([text async for text in self.deltas()])

    async def close(self) -> None:
        """Close the engine iterator; if it had not finished, that cancels the request."""
        await self._events.aclose()

    def prompt_logprobs(self) -> list[TokenLogprob]:
        """echo: the prompt tokens with their logprobs (None for the first, which nothing predicts)."""
        scored = (self._first.prompt_logprobs if self._first is not None else None) or []
        out = []
        for i, token_id in enumerate(self.request.prompt_ids):
            entry = scored[i] if i < len(scored) else None
            out.append(TokenLogprob(token_id, None) if entry is None else
                       TokenLogprob(token_id, entry[0], tuple(entry[1])))
        return out

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens consumed since the last call: after a delta, those of the
        tokens that made it (and of tokens held back before it, whose text it carries)."""
        taken, self._logprobs = self._logprobs, []
        return taken

    def _consume(self, event: TokenEvent) -> str:
        if self._discard:
            if event.finish_reason is not None:
                self.finish_reason = "length"
            return ""
        text = ""
        if event.finish_reason is not None:
            self.ctx.metrics.observe_speculation(event.stats.get("speculative"))
        if event.token_id is not None:
            now = time.perf_counter()
            self.ctx.metrics.observe_token(now - self._last_time, first=self.completion_tokens == 0)
            self._last_time = now
            self.completion_tokens += 1
            # The EOS that ends the request (finish "stop" from the engine) is not part of the text.
            if event.logprob is not None and self.request.logprobs is not None and event.finish_reason != "stop":
                self._logprobs.append(TokenLogprob(event.token_id, event.logprob, tuple(event.top_logprobs or ())))
            eos = self.ctx.tokenizer.eos_ids
            ending = self._keep_special and event.finish_reason == "stop" and event.token_id in eos
            text, hit = self._stops.push("" if ending else self._decoder.push(event.token_id))
            if hit:
                self.finish_reason = "stop"
                return text
        if event.finish_reason is not None:
            tail, hit = self._stops.push(self._decoder.flush())
            text += tail if hit else tail + self._stops.flush()
            self.finish_reason = "stop" if hit else event.finish_reason
        return text


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    raise ClientDisconnected()


# ---------------------------------------------------------------- endpoints

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
        return ChatOutput(parsed.tool_format, parsed.toolset, parsed.output_prefix,
                          reasoning=ctx.thinks and parsed.reasoning_format != "none",
                          thinking_open=self.thinking_open)


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


class ClosingStreamingResponse(StreamingResponse):
    """Closes the body iterator however the response ends.

    On a client disconnect Starlette cancels the send loop and leaves the
    generator suspended; closing it here is what cancels the engine request.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def _generate(request: Request, parse: Parser) -> Response:
    """The event loop moves bytes; parsing, rendering, tokenising and assembling run in ctx.work."""
    ctx: ServerContext = request.app.state.ctx
    prep = ctx.prep_context()
    parsed = await ctx.work.run(parse_request, prep, await read_body(request, ctx.max_body_bytes), parse)
    if not ctx.engine.is_ready():
        raise EngineError("the model is still loading", 503, "not_ready")
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
                                parsed.options.echo_only, events=events,
                                keep_special=parsed.toolset.active and parsed.tool_format.keeps_special)
            choices.append(Choice(len(choices), stream, prompt.echo, first=c == 0,
                                  thinking_open=prompt.thinking_open))

    async def close() -> None:
        for c in choices:
            await c.stream.close()
        for fan in fans:
            await fan.aclose()

    handed_off = False
    try:
        await unless_disconnected(request, asyncio.gather(*(c.stream.start() for c in choices)))
        if parsed.options.stream:
            handed_off = True
            return ClosingStreamingResponse(
                sse_events(ctx, choices, parsed, close), media_type="text/event-stream", headers=SSE_HEADERS
            )
        texts = await unless_disconnected(request, asyncio.gather(*(c.stream.collect() for c in choices)))
    except ClientDisconnected:
        ctx.metrics.count_error("client_disconnect")
        logger.info("client disconnected; request cancelled")
        return Response(status_code=499)
    finally:
        if not handed_off:
            await close()
    body = await ctx.work.run(lambda: dumps_in_parts(_full_response(ctx, parsed, choices, list(texts))))
    return Response(body, media_type="application/json")


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


def _install_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = ctx.engine.is_ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = ctx.metrics.render()
        return Response(payload, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "skippy_zmq",
                "max_model_len": ctx.engine.max_context}
        return {"object": "list", "data": [card]}

    @app.post(CHAT.endpoint)
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, parse_chat)

    @app.post(COMPLETION.endpoint)
    async def completions(request: Request) -> Response:
        return await _generate(request, parse_completion)

    parts = anthropic_api.ServerParts(TextStream, unless_disconnected, ClientDisconnected, ClosingStreamingResponse)
    anthropic_api.install_routes(app, ctx, parts)   # /v1/messages, /v1/messages/count_tokens
    responses_api.install_routes(app, ctx, parts)   # /v1/responses, /v1/responses/{id}
    embeddings_api.install_routes(app, ctx, parts)  # /v1/embeddings
    console.install_routes(app, ctx)   # the page at /, its assets, /v1/console/status


def tool_template(tokenizer: TextTokenizer) -> str:
    """The chat template a request with tools renders with: the named `tool_use` one if the
    model has it, else the default."""
    named = tokenizer.meta.get("chat_templates") or {}
    return (named.get("tool_use") if isinstance(named, dict) else None) or tokenizer.meta.get("chat_template") or ""


def create_app(engine: Engine, tokenizer: TextTokenizer, *, model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
               metrics: ServerMetrics | None = None, keys: ApiKeys | None = None,
               edge: EdgeConfig = EdgeConfig()) -> FastAPI:
    """The OpenAI-compatible app. `model_name` defaults to engine.model_name;
    pass `metrics` to share a registry with the scheduler. `keys` (or just `api_key`) and `edge`
    (hosts, origins, body deadline) set the checks of http_guard."""
    keys = keys if keys is not None else ApiKeys.of(api_key)
    template = tool_template(tokenizer)
    ctx = ServerContext(engine, tokenizer, model_name or engine.model_name,
                        metrics or ServerMetrics(), keys.api.decode() if keys.api else None, max_body_bytes,
                        tool_format=tools.choose_format(template), thinks=template_thinks(template))
    app = FastAPI(title="skippy_zmq", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.state.edge = edge   # start_in_thread / serve take the connection limits from here
    _install_error_handlers(app, ctx)
    _install_routes(app, ctx)
    app.add_middleware(HttpMiddleware, ctx=ctx, guard=Guard(edge, keys))
    return app


# ---------------------------------------------------------------- serving

def serve(app: FastAPI, host: str, port: int, *, log_level: str = "info") -> None:
    """Serve until interrupted (blocking), with the app's edge limits (create_app's `edge`)."""
    uvicorn.Server(uvicorn_config(app, app.state.edge, _counter(app), host=host, port=port,
                                  log_level=log_level)).run()


def _counter(app: FastAPI) -> Callable[[int], None]:
    """Counts the connections the protocol turns away (slow headers, caps) as errors by kind."""
    metrics = app.state.ctx.metrics
    return lambda status: metrics.count_error(error_kind(status))


class _ThreadServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


@dataclass
class ServerHandle:
    """A server running in a background thread; `stop()` shuts it down."""

    server: _ThreadServer
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def start_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                    startup_timeout_s: float = 30.0) -> ServerHandle:
    """Start serving in a daemon thread; returns once the server accepts connections.

    We bind the socket ourselves so port 0 yields a known free port at once.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn_config(app, app.state.edge, _counter(app), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)
    server = _ThreadServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"http-{sock.getsockname()[1]}")
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.ready.wait(0.05):  # bounded: a failed startup ends the thread
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"HTTP server on {host}:{port} failed to start")
    return ServerHandle(server, thread, host, sock.getsockname()[1])
