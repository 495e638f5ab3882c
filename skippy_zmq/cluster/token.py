"""Join tokens: everything a worker needs to open an authenticated, encrypted link to a driver.

    skz1.<base64url of {"e": endpoint, "k": driver's CURVE public key, "s": a CURVE secret key,
                       "x": expiry (unix seconds)}>

The driver makes a fresh CURVE keypair per token (`issue`) and admits its public key until the
expiry; the worker connects as that key's owner (CURVE proves it holds the secret), and checks the
driver's key, so neither side can be impersonated by someone without the token. The expiry inside
the token is for the worker's messages only: the driver enforces its own copy, so editing it gains
nothing. A token is a secret: whoever holds it can join until it expires.

No sockets, no JAX.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

PREFIX = "skz1."
MAX_TOKEN_CHARS = 2048
_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")     # Z85 of 32 bytes
_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9_.\-\[\]:]+:\d{1,5}")


class TokenError(ValueError):
    """A join token that is malformed; the message says what is wrong (never the secret)."""


@dataclass(frozen=True)
class JoinToken:
    endpoint: str                          # the driver's cluster ROUTER, as workers dial it
    server_key: bytes                      # the driver's CURVE public key (Z85)
    secret: bytes = field(repr=False)      # this token's CURVE secret key (Z85)
    expires_at: float                      # unix seconds

    @property
    def public(self) -> bytes:
        """The public key the driver admits for this token."""
        return zmq.curve_public(self.secret)

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def text(self) -> str:
        body = {"e": self.endpoint, "k": self.server_key.decode(), "s": self.secret.decode(),
                "x": int(self.expires_at)}
        raw = json.dumps(body, separators=(",", ":")).encode()
        return PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def issue(endpoint: str, server_key: bytes, ttl_s: float, now: float | None = None) -> JoinToken:
    """A new token (its own keypair) for workers dialing `endpoint`, valid for `ttl_s` seconds."""
    _public, secret = zmq.curve_keypair()
    return JoinToken(endpoint, server_key, secret, (time.time() if now is None else now) + ttl_s)


def parse(text: str) -> JoinToken:
    """A token's fields, every one checked; TokenError says which part is wrong."""
    text = text.strip()
    if len(text) > MAX_TOKEN_CHARS:
        raise TokenError(f"join token is {len(text)} characters; a real one is under {MAX_TOKEN_CHARS}")
    if not text.startswith(PREFIX):
        raise TokenError(f"not a join token: it must start with {PREFIX!r} (copy the whole line the driver printed)")
    try:
        body64 = text[len(PREFIX):]
        raw = base64.urlsafe_b64decode(body64 + "=" * (-len(body64) % 4))
        body = json.loads(raw)
    except (binascii.Error, ValueError):
        raise TokenError("join token is damaged (not base64url JSON): copy the whole line the driver printed") from None
    if not isinstance(body, dict) or set(body) != {"e", "k", "s", "x"}:
        raise TokenError("join token is damaged: expected the fields e, k, s, x")
    if not (isinstance(body["e"], str) and _ENDPOINT.fullmatch(body["e"])):
        raise TokenError(f"join token's endpoint {body['e']!r} is not tcp://host:port")
    for name in ("k", "s"):
        if not (isinstance(body[name], str) and _KEY.fullmatch(body[name])):
            raise TokenError("join token's keys are damaged (not 40-character Z85 CURVE keys)")
    try:
        z85.decode(body["s"])
    except ValueError:
        raise TokenError("join token's keys are damaged (not Z85)") from None
    if isinstance(body["x"], bool) or not isinstance(body["x"], int):
        raise TokenError("join token's expiry is not a number")
    return JoinToken(body["e"], body["k"].encode(), body["s"].encode(), float(body["x"]))
