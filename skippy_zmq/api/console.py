"""The console: a chat page and a live pipeline view at `/`, static files shipped in the package.

The page and its assets are public (like /health): they hold no data. Every data call the page
makes goes to /v1/..., behind the API key like the rest of the API; the page sends the key the
user typed (kept in sessionStorage) as `Authorization: Bearer`. The assets load from this server
only and the page runs no inline script, so a strict Content-Security-Policy holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from skippy_zmq.api.console_status import ConsoleStatus, PipelineTelemetry

if TYPE_CHECKING:
    from skippy_zmq.engine.pipeline import PipelineEngine
    from skippy_zmq.api.context import ServerContext

ASSET_DIR = "console_assets"   # skippy_zmq/api/console_assets/ (setup.cfg package_data)
STATUS_ENDPOINT = "/v1/console/status"
# Paths a browser may load: path -> (file, content type).
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console/console.css": ("console.css", "text/css; charset=utf-8"),
    "/console/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/console/pipeline.js": ("pipeline.js", "text/javascript; charset=utf-8"),
    "/console/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
ENDPOINTS = (*ASSETS, STATUS_ENDPOINT)
# Only this server's own files and API; no inline script or style, no plugins, no framing, no forms
# posting elsewhere, no <base> rewriting.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                           "connect-src 'self'; font-src 'none'; object-src 'none'; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str


def load_assets() -> dict[str, Asset]:
    """Every asset, read once from the package (a few kB)."""
    folder = resources.files("skippy_zmq.api").joinpath(ASSET_DIR)
    return {path: Asset(folder.joinpath(name).read_bytes(), content_type) for path, (name, content_type) in ASSETS.items()}


def install_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`/` and its assets, and GET /v1/console/status; the status source is kept on app.state.console."""
    assets = load_assets()
    status = ConsoleStatus(ctx)
    app.state.console = status

    def serve(asset: Asset):
        async def handler() -> Response:
            return Response(asset.body, media_type=asset.content_type,
                            headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})
        return handler

    for path, asset in assets.items():
        app.add_api_route(path, serve(asset), methods=["GET"], include_in_schema=False)

    @app.get(STATUS_ENDPOINT, include_in_schema=False)
    async def console_status() -> JSONResponse:
        body = await run_in_threadpool(status.build)   # reads the pipeline thread's state under its locks
        return JSONResponse(body, headers={**SECURITY_HEADERS, "Cache-Control": "no-store"})


def watch_pipeline(app: FastAPI, engine: PipelineEngine) -> PipelineTelemetry:
    """Show `engine`'s stages on this app's console: its replies feed the telemetry from now on."""
    telemetry = PipelineTelemetry(engine)
    engine.on_reply_hooks.append(telemetry.on_reply)
    app.state.console.pipeline = telemetry
    return telemetry
