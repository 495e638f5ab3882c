"""Checks for the values of a YAML config, each naming the file and the key path of what it refuses
(At), and the mapping reader that applies them with a dataclass's defaults (topology_yaml.py)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

from skippy_zmq.config.topology import TopologyError
from skippy_zmq.config.units import parse_bytes


@dataclass(frozen=True)
class At:
    """Where in which file a value sits, for error messages."""

    source: str
    path: str = ""

    def key(self, key: Any) -> At:
        return At(self.source, f"{self.path}.{key}" if self.path else str(key))

    def item(self, i: int) -> At:
        return At(self.source, f"{self.path}[{i}]")

    def fail(self, message: str) -> NoReturn:
        raise TopologyError(f"{self.source}: {self.path}: {message}" if self.path else f"{self.source}: {message}")


Check = Callable[[Any, At], Any]
TCP = re.compile(r"^tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d+)$")


def integer(low: int, high: int | None = None) -> Check:
    def check(value: Any, at: At) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            at.fail(f"expected an integer, got {value!r}")
        if value < low:
            at.fail(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            at.fail(f"must be at most {high}, got {value}")
        return value

    return check


def cpus(value: Any, at: At) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or \
            not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value):
        at.fail(f"expected a non-empty list of CPU numbers, got {value!r}")
    if len(set(value)) != len(value):
        at.fail(f"lists a CPU twice: {value!r}")
    return tuple(value)


def memory(value: Any, at: At) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        at.fail(str(exc))


def seconds(value: Any, at: At) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        at.fail(f"expected a number, got {value!r}")
    if not 0 < value < math.inf:
        at.fail(f"must be a positive number, got {value}")
    return float(value)


def text(value: Any, at: At) -> str:
    if not isinstance(value, str) or not value.strip():
        at.fail(f"expected a non-empty string, got {value!r}")
    return value


# A stage id names files in the run folder and appears on command lines: a plain name, never a path
# or an option. A host reaches ssh's argv: a hostname, IPv4, [IPv6] (or bare IPv6), with user@.
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SAFE_HOST = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.-]*@)?([A-Za-z0-9_][A-Za-z0-9_.-]{0,252}|\[[0-9A-Fa-f:.]+\]"
                        r"|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*)")


def stage_id(value: Any, at: At) -> str:
    if not isinstance(value, str) or not _SAFE_ID.fullmatch(value):
        at.fail(f"expected a name of letters, digits, '_', '.', '-' (not starting with '-' or '.', "
                f"at most 64), got {value!r}")
    return value


def host(value: Any, at: At) -> str:
    if not isinstance(value, str) or not _SAFE_HOST.fullmatch(value):
        at.fail(f"expected a hostname, IPv4, [IPv6] or user@host (no leading '-', no spaces), got {value!r}")
    return value


def choice(*options: str) -> Check:
    def check(value: Any, at: At) -> str:
        if value not in options:
            at.fail(f"expected one of {', '.join(options)}, got {value!r}")
        return value

    return check


def device(value: Any, at: At) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"cpu|(gpu|tpu):\d+", value):
        at.fail(f"expected cpu, gpu:N or tpu:N, got {value!r}")
    return value


def _port(port: str, at: At) -> int:
    if not 1 <= int(port) <= 65535:
        at.fail(f"port {port} is outside 1..65535")
    return int(port)


def endpoint(value: Any, at: At) -> str:
    if isinstance(value, str) and (m := TCP.match(value)):
        _port(m["port"], at)
    elif not (isinstance(value, str) and re.fullmatch(r"(ipc|inproc)://\S+", value)):
        at.fail(f"expected tcp://host:port, ipc://path or inproc://name, got {value!r}")
    return value


def dial(value: Any, at: At) -> str | None:
    """An endpoint a peer can dial (no wildcard host), or null for the default."""
    if value is None:
        return None
    m = TCP.match(endpoint(value, at))
    if m and m["host"] in ("*", "0.0.0.0"):
        at.fail(f"a peer cannot dial the wildcard host of {value!r}; name the host")
    return value


def hostport(value: Any, at: At) -> str:
    if not (isinstance(value, str) and (m := TCP.match(f"tcp://{value}")) and m["host"] != "*"):
        at.fail(f"expected host:port, got {value!r}")
    _port(m["port"], at)
    return value


def layers(value: Any, at: At) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
        at.fail(f"expected [start, end] (two integers, end exclusive), got {value!r}")
    start, end = value
    if not 0 <= start < end:
        at.fail(f"[{start}, {end}) is empty or negative: need 0 <= start < end")
    return start, end


def read_mapping(raw: Any, at: At, checks: dict[str, Check], defaults: dict[str, Any]) -> dict[str, Any]:
    """Check one mapping against `checks`; missing keys take `defaults` (absent there = required)."""
    if not isinstance(raw, dict):
        at.fail(f"expected a mapping, got {raw!r}")
    for key in raw:
        if key not in checks:
            at.key(key).fail(f"unknown key (allowed: {', '.join(sorted(checks))})")
    out = {}
    for key, check in checks.items():
        if key in raw:
            out[key] = check(raw[key], at.key(key))
        elif key in defaults:
            out[key] = defaults[key]
        else:
            at.key(key).fail("required key is missing")
    return out


def dataclass_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def section(cls: type, checks: dict[str, Check]) -> Check:
    """A check for a nested mapping whose keys are exactly `cls`'s fields."""
    return lambda raw, at: cls(**read_mapping(raw, at, checks, dataclass_defaults(cls)))

