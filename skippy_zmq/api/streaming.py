"""The respond flow every generating API shape shares, once its request is parsed and submitted:
wait for the first events (so an engine error is still an HTTP status), then either hand a
server-sent-events body to a response that closes it however it ends, or collect the whole answer
while watching for the client going away (a 499, the request cancelled); the engine's streams are
closed on every path that does not hand them off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from loguru import logger
from starlette.types import Receive, Scope, Send

from skippy_zmq.api.context import ServerContext

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before a non-streamed answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    # Whether `work` finished first, not `task.cancelled()`: a cancelled gather() (several choices)
    # ends with CancelledError set as its exception, so it never reads as cancelled.
    if task in done:
        return task.result()
    raise ClientDisconnected()


def client_gone(ctx: ServerContext) -> Response:
    """The answer to a client that left before it was ready (nobody reads it): counted, 499."""
    ctx.metrics.count_error("client_disconnect")
    logger.info("client disconnected; request cancelled")
    return Response(status_code=499)


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


@dataclass(frozen=True)
class Reply(Generic[T]):
    """How one API shape answers a request already submitted to the engine (see `respond`)."""

    start: Callable[[], Awaitable[object]]         # until the first events: an engine error is still a status
    events: Callable[[], AsyncIterator[bytes]]     # the SSE body: errors in-band, the streams closed at its end
    collect: Callable[[], Awaitable[T]]            # the whole answer, not streamed
    finish: Callable[[T], Awaitable[Response]]     # the collected answer as the response (streams closed by then)
    close: Callable[[], Awaitable[None]]           # close the engine's streams: cancels what has not finished


async def respond(ctx: ServerContext, request: Request, reply: Reply[T], stream: bool) -> Response:
    """`reply` streamed (`stream`) or whole; a client gone before the answer is ready gets a 499."""
    handed_off = False
    try:
        await unless_disconnected(request, reply.start())
        if stream:
            handed_off = True
            return ClosingStreamingResponse(reply.events(), media_type="text/event-stream", headers=SSE_HEADERS)
        collected = await unless_disconnected(request, reply.collect())
    except ClientDisconnected:
        return client_gone(ctx)
    finally:
        if not handed_off:
            await reply.close()
    return await reply.finish(collected)
