"""The app's outermost layer, as plain ASGI: a request id, the edge's checks (http_guard), request
metrics by endpoint, and last-resort 500s / 408s."""

from __future__ import annotations

import re
import time
import uuid

from fastapi.responses import Response
from loguru import logger
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skippy_zmq.api import console, embeddings_api
from skippy_zmq.api.anthropic_schema import COUNT_TOKENS_ENDPOINT, MESSAGES_ENDPOINT
from skippy_zmq.api.context import ServerContext, error_response
from skippy_zmq.api.http_guard import BodyTimeout, Guard, expects_body, header
from skippy_zmq.api.openai_responses import CHAT, COMPLETION
from skippy_zmq.api.responses_schema import RESPONSES_ENDPOINT

GENERATION_ENDPOINTS = (CHAT.endpoint, COMPLETION.endpoint, MESSAGES_ENDPOINT, RESPONSES_ENDPOINT,
                        embeddings_api.EMBEDDINGS_ENDPOINT)
KNOWN_ENDPOINTS = (*GENERATION_ENDPOINTS, COUNT_TOKENS_ENDPOINT, "/v1/models", "/health", "/readyz", "/metrics",
                   *console.ENDPOINTS)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


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

