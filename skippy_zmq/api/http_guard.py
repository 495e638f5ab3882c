"""The HTTP edge's per-request checks, in the order a request meets them.

1. Host: only the names this server answers to (DNS rebinding: a page on evil.example whose
   name is re-pointed at 127.0.0.1 still sends `Host: evil.example`) -> else 421.
2. Origin: a browser's cross-origin call only from an allowed origin -> else 403; a CORS
   preflight from one is answered here, before any key is asked for.
3. Key: every route but /health and /readyz needs the API key (`Authorization: Bearer K` or
   `X-Api-Key: K`); /metrics takes the metrics key too, or none with `metrics_public` -> else 401.
   Keys are compared as bytes with hmac.compare_digest (constant time, any header bytes).
4. Body: a POST must say `Content-Type: application/json` (a form or `text/plain` POST is how a
   page avoids a preflight) -> else 415; its body must arrive within `body_timeout_s` -> else 408.

Connection-level limits (connection caps, header deadline, header size) are in http_protocol.py.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger
from starlette.types import Message, Receive, Scope

from skippy_zmq.config.http import EdgeConfig, split_host

OPEN_PATHS = ("/health", "/readyz", "/")   # liveness probes and the console page: no key, reveal nothing
OPEN_PREFIXES = ("/console/",)              # the console's static files (its data calls go to /v1/*)
METRICS_PATH = "/metrics"
BODY_METHODS = ("POST", "PUT", "PATCH")
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_DEFAULT_HEADERS = "Authorization, Content-Type, X-Api-Key, X-Request-Id"
CORS_MAX_AGE_S = 600
MAX_KEY_BYTES = 4096
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


class KeySourceError(ValueError):
    """An API key file or value that cannot be used (missing, empty, not printable ASCII)."""


class BodyTimeout(Exception):
    """The request body did not arrive within the body deadline."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"request body not received within {seconds:g} s")


# ---------------------------------------------------------------- keys

@dataclass(frozen=True)
class ApiKeys:
    """The keys a server checks, as bytes: `api` guards the API, `metrics` (if set) also opens /metrics."""

    api: bytes | None = None
    metrics: bytes | None = None

    @classmethod
    def of(cls, api: str | None, metrics: str | None = None) -> ApiKeys:
        return cls(checked_key(api, "API key") if api else None,
                   checked_key(metrics, "metrics key") if metrics else None)


def checked_key(key: str, what: str) -> bytes:
    """A key as the bytes a client sends: 1..MAX_KEY_BYTES visible ASCII characters."""
    if not 0 < len(key) <= MAX_KEY_BYTES or not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise KeySourceError(f"the {what} must be 1..{MAX_KEY_BYTES} visible ASCII characters (no spaces)")
    return key.encode("ascii")


def read_key_file(path: Path, what: str) -> str:
    """A key from a file (first line, stripped); warns when others could read it."""
    try:
        info = path.stat()
        if info.st_size > MAX_KEY_BYTES + 2:
            raise KeySourceError(f"{what} file {path} is {info.st_size} bytes; a key is at most {MAX_KEY_BYTES}")
        text = path.read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise KeySourceError(f"cannot read the {what} file {path}: {err}") from None
    if info.st_mode & 0o077 or info.st_uid != os.geteuid():
        logger.warning("{} file {} is mode {:o}, owner uid {}: make it yours and owner-only (chmod 600)",
                       what, path, info.st_mode & 0o777, info.st_uid)
    if not text:
        raise KeySourceError(f"{what} file {path} is empty")
    return text


def resolve_keys(api_key: str | None, api_key_file: str | None, metrics_key_file: str | None,
                 environ: Mapping[str, str]) -> ApiKeys:
    """The server's keys from (in order) a file, the command line, the environment.

    A key on the command line works but is visible to every user in `ps`: warned about.
    """
    api: str | None = None
    if api_key_file:
        api = read_key_file(Path(api_key_file), "API key")
    elif api_key:
        logger.warning("--api-key puts the key in the command line, where `ps` shows it to every user: "
                       "use --api-key-file or SKIPPY_API_KEY")
        api = api_key
    elif environ.get("SKIPPY_API_KEY"):
        api = environ["SKIPPY_API_KEY"]
    if sum(bool(s) for s in (api_key_file, api_key, environ.get("SKIPPY_API_KEY"))) > 1:
        logger.warning("several API keys given; using the first of --api-key-file, --api-key, SKIPPY_API_KEY")
    metrics = read_key_file(Path(metrics_key_file), "metrics key") if metrics_key_file \
        else environ.get("SKIPPY_METRICS_KEY") or None
    return ApiKeys.of(api, metrics)


# ---------------------------------------------------------------- request checks

@dataclass(frozen=True)
class Refusal:
    """A request turned away at the edge: an error response's status, message and code."""

    status: int
    message: str
    code: str
    headers: dict[str, str] = field(default_factory=dict)


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class Guard:
    """The checks above for one server (its settings and keys)."""

    def __init__(self, edge: EdgeConfig, keys: ApiKeys) -> None:
        self.edge, self.keys = edge, keys
        self._hosts = [split_host(h) for h in edge.allowed_hosts if h != "*"]   # valid: http_config checked them
        self._any_host = "*" in edge.allowed_hosts
        self._any_origin = "*" in edge.allowed_origins

    def admit(self, scope: Scope) -> Refusal | None:
        """Host and Origin: is this request for us, from a caller allowed to send it?"""
        raw_host = (header(scope, b"host") or b"").decode("latin-1")
        if not self._host_allowed(raw_host, scope):
            return Refusal(421, f"Host {raw_host[:200]!r} is not served here (allowed hosts: "
                           f"{', '.join(self.edge.allowed_hosts) or 'this server by address or localhost'}; "
                           "--allowed-hosts adds names)", "host_not_allowed")
        origin = self.origin(scope)
        if origin is not None and not self._origin_allowed(origin, raw_host, scope):
            return Refusal(403, f"Origin {origin[:200]!r} is not allowed (--allowed-origins)", "origin_not_allowed")
        return None

    def origin(self, scope: Scope) -> str | None:
        raw = header(scope, b"origin")
        return None if raw is None else raw.decode("latin-1").strip().lower().rstrip("/")

    def _host_allowed(self, raw: str, scope: Scope) -> bool:
        if self._any_host:
            return True
        parsed = split_host(raw) if raw else None
        if parsed is None:
            return False
        name, port = parsed
        port = port if port is not None else (443 if scope.get("scheme") == "https" else 80)
        if self._hosts:
            return any(entry is not None and entry[0] == name and entry[1] in (None, port) for entry in self._hosts)
        local, server_port = scope.get("server") or ("", None)
        local = f"[{local}]" if ":" in local else local   # an IPv6 address as a Host names it
        return name in (*LOOPBACK_NAMES, local.lower()) and port == server_port

    def _origin_allowed(self, origin: str, raw_host: str, scope: Scope) -> bool:
        same = origin == f"{scope.get('scheme', 'http')}://{raw_host.strip().lower()}"
        return same or self._any_origin or origin in self.edge.allowed_origins

    def cors_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """Headers that let an allowed cross-origin page read the response (none for other requests)."""
        origin = self.origin(scope)
        if origin is None or not (self._any_origin or origin in self.edge.allowed_origins):
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                (b"access-control-expose-headers", b"X-Request-Id")]

    def preflight(self, scope: Scope) -> dict[str, str] | None:
        """The headers of a 204 answer if this is a CORS preflight (OPTIONS + Access-Control-Request-Method)."""
        if scope["method"] != "OPTIONS" or header(scope, b"access-control-request-method") is None:
            return None
        asked = (header(scope, b"access-control-request-headers") or b"").decode("latin-1").strip()
        return {"Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": asked or CORS_DEFAULT_HEADERS,
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S)}

    def authorize(self, scope: Scope) -> Refusal | None:
        """The key check: which keys open this path, and did the client present one of them?"""
        path = scope["path"]
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return None
        if path == METRICS_PATH:
            keys = [] if self.edge.metrics_public else [k for k in (self.keys.metrics, self.keys.api) if k]
        else:
            keys = [self.keys.api] if self.keys.api else []
        if not keys or any(hmac.compare_digest(given, key) for given in _presented(scope) for key in keys):
            return None
        return Refusal(401, "invalid or missing API key (send Authorization: Bearer KEY or X-Api-Key: KEY)",
                       "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    def media_type(self, scope: Scope) -> Refusal | None:
        """A body-carrying request must be JSON, declared as such."""
        if scope["method"] not in BODY_METHODS:
            return None
        declared = (header(scope, b"content-type") or b"").decode("latin-1")
        media = declared.split(";")[0].strip().lower()
        if media == "application/json":
            return None
        got = f"got {media[:100]!r}" if media else "none was given"
        return Refusal(415, f"Content-Type must be application/json; {got}", "unsupported_media_type")

    def body_deadline(self, receive: Receive) -> BodyDeadline:
        return BodyDeadline(receive, self.edge.body_timeout_s)


class BodyDeadline:
    """`receive` for the app, raising BodyTimeout once the body has not all come within `seconds`
    of the request's start. After the body, messages (a disconnect) pass with no deadline.
    `complete` says whether the whole body was read: a response sent before that must close the
    connection, or a client could trickle the unread rest forever."""

    def __init__(self, receive: Receive, seconds: float) -> None:
        self._receive, self.seconds = receive, seconds
        self._deadline = asyncio.get_running_loop().time() + seconds
        self.complete = False

    async def __call__(self) -> Message:
        if self.complete:
            return await self._receive()
        try:
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            raise BodyTimeout(self.seconds) from None
        self.complete = message["type"] != "http.request" or not message.get("more_body", False)
        return message


def expects_body(scope: Scope) -> bool:
    """The request announced a body (a non-zero Content-Length, or chunked)."""
    length = header(scope, b"content-length")
    return header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() not in (b"", b"0"))


def _presented(scope: Scope) -> list[bytes]:
    """The keys a request presents: `Authorization: Bearer K` and/or `X-Api-Key: K`, as raw bytes."""
    given = []
    auth = header(scope, b"authorization")
    if auth is not None and auth[:7].lower() == b"bearer ":
        given.append(auth[7:].strip())
    api_key = header(scope, b"x-api-key")
    if api_key is not None:
        given.append(api_key.strip())
    return given
