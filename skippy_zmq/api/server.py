"""The OpenAI-compatible HTTP server over an Engine (FastAPI + uvicorn): the app factory, which
wires the context, the error handlers, every API shape's routes and the edge middleware, and the
two ways to serve it (blocking, or in a background thread).

Each API shape lives in its own module: completions_api (chat and text completions),
anthropic_api (messages), responses_api, embeddings_api, console (the web page); they share the
ServerContext (context.py), the text streams (text_stream.py) and the respond flow (streaming.py).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from skippy_zmq.api import anthropic_api, completions_api, console, embeddings_api, responses_api
from skippy_zmq.api.context import ServerContext, engine_error_response, error_response
from skippy_zmq.api.http_guard import ApiKeys, Guard
from skippy_zmq.api.http_protocol import uvicorn_config
from skippy_zmq.api.middleware import HttpMiddleware
from skippy_zmq.api.openai_schema import RequestError
from skippy_zmq.config.http import EdgeConfig
from skippy_zmq.engine.metrics import ServerMetrics, error_kind
from skippy_zmq.engine.request import Engine, EngineError
from skippy_zmq.text import tools
from skippy_zmq.text.reasoning import template_thinks
from skippy_zmq.text.tokenizer import TextTokenizer

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


# ---------------------------------------------------------------- the app

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

    completions_api.install_routes(app)             # /v1/chat/completions, /v1/completions
    anthropic_api.install_routes(app, ctx)          # /v1/messages, /v1/messages/count_tokens
    responses_api.install_routes(app, ctx)          # /v1/responses, /v1/responses/{id}
    embeddings_api.install_routes(app, ctx)         # /v1/embeddings
    console.install_routes(app, ctx)                # the page at /, its assets, /v1/console/status


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
