"""The HTTP edge's settings: who may call (hosts, origins) and how much a caller may hold.

YAML ``driver.http_edge`` (every key optional; defaults shown)::

    http_edge:
      allowed_hosts: []            # Host header values served; [] = localhost, 127.0.0.1, [::1] and the
                                   # address the request came in on, on the server's port ("*": any).
                                   # An entry without a port matches any port. Guards DNS rebinding.
      allowed_origins: []          # browser origins (scheme://host[:port]) that may call cross-origin;
                                   # [] = same-origin only, "*" = any. Others get 403.
      metrics_public: false        # /metrics without a key even when an API key is set
      max_connections: 512         # open connections at once; more are answered 503 and closed
      max_connections_per_client: 128  # open connections from one client address; more get 429 (above
                                   # max_sessions + max_queue: one busy local client or proxy is not cut)
      header_timeout_s: 10         # a request's headers must arrive within this (slowloris); else 408
      body_timeout_s: 30           # its body within this, counted from the headers; else 408
      keep_alive_s: 5              # an idle keep-alive connection is closed after this
      max_header_bytes: 16384      # request line + headers; larger is a 400

Only the settings; the checks themselves are in http_guard.py (ASGI) and http_protocol.py
(connection level). API keys never live here: they come from a file or the environment.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_LIST_ENTRIES = 64
_ORIGIN = re.compile(r"(\*|null|[a-z][a-z0-9+.-]*://[^/\s]+)")


class EdgeConfigError(ValueError):
    """A bad `http_edge` setting; `key` names it ("" for the section itself)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class EdgeConfig:
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    metrics_public: bool = False
    max_connections: int = 512
    max_connections_per_client: int = 128
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_header_bytes: int = 16 * 1024

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EdgeConfig:
        """Validate a mapping (YAML ``driver.http_edge``); missing keys take the defaults."""
        if not isinstance(raw, Mapping):
            raise EdgeConfigError("", f"expected a mapping, got {raw!r}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in raw:
            if key not in allowed:
                raise EdgeConfigError(str(key), f"unknown key (allowed: {', '.join(sorted(allowed))})")
        fields = dict(raw)
        for key in ("allowed_hosts", "allowed_origins"):
            if key in fields:
                fields[key] = names(key, fields[key])
        if not isinstance(fields.get("metrics_public", False), bool):
            raise EdgeConfigError("metrics_public", f"expected true or false, got {fields['metrics_public']!r}")
        for key, low in (("max_connections", 1), ("max_connections_per_client", 1), ("max_header_bytes", 1024)):
            _integer(key, fields.get(key, 1 << 20), low)
        for key in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            fields[key] = _seconds(key, fields.get(key, 1.0))
        return cls(**fields)

    def with_hosts(self, hosts: tuple[str, ...] | None, origins: tuple[str, ...] | None,
                   metrics_public: bool) -> EdgeConfig:
        """Command-line overrides: a given list replaces the topology's; --metrics-public adds."""
        return dataclasses.replace(self, allowed_hosts=self.allowed_hosts if hosts is None else hosts,
                                   allowed_origins=self.allowed_origins if origins is None else origins,
                                   metrics_public=self.metrics_public or metrics_public)


def names(key: str, value: Any) -> tuple[str, ...]:
    """Hosts (`name[:port]`, `[v6][:port]`, `*`) or origins (`scheme://host[:port]`, `null`, `*`),
    lower-cased; a comma-separated string is split. `key` says which (it ends in _hosts or _origins)."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or len(value) > MAX_LIST_ENTRIES:
        raise EdgeConfigError(key, f"expected a list of at most {MAX_LIST_ENTRIES} names, got {value!r}")
    out = []
    for item in value:
        if not isinstance(item, str) or not item.strip() or any(c.isspace() or ord(c) > 126 for c in item.strip()):
            raise EdgeConfigError(key, f"expected a name without spaces, got {item!r}")
        name = item.strip().lower().rstrip("/")
        if key.endswith("hosts") and name != "*" and split_host(name) is None:
            raise EdgeConfigError(key, f"expected name, name:port or [v6]:port, got {item!r}")
        if key.endswith("origins") and not _ORIGIN.fullmatch(name):
            raise EdgeConfigError(key, f"expected scheme://host[:port], null or *, got {item!r}")
        out.append(name)
    return tuple(out)


def split_host(value: str) -> tuple[str, int | None] | None:
    """`name[:port]` / `[v6][:port]` -> (lower-case name, port or None); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = (value[:end + 1], value[end + 1:]) if end > 0 else ("", "")
    else:
        name, colon, port = value.partition(":")
        rest = colon + port
    if not name or (rest and not (rest[:1] == ":" and rest[1:].isdigit() and len(rest) <= 6)):
        return None
    return name, int(rest[1:]) if rest else None


def _integer(key: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EdgeConfigError(key, f"expected an integer, got {value!r}")
    if value < low:
        raise EdgeConfigError(key, f"must be at least {low}, got {value}")


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EdgeConfigError(key, f"expected a number of seconds, got {value!r}")
    if not 0 < value < math.inf:
        raise EdgeConfigError(key, f"must be a positive number, got {value}")
    return float(value)
