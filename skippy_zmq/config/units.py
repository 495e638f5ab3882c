"""Byte counts as people write them ("6GiB", "512 MiB", "1.5GB") and as we print them."""

from __future__ import annotations

import re

MiB, GiB = 1 << 20, 1 << 30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: int | str) -> int:
    """A byte count: an integer, or a string such as "6GiB", "512 MiB", "1.5GB" (KB/MB/GB: powers of 10)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"a byte count must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"expected bytes such as 6GiB, 512MiB, 8GB or an integer, got {value!r}")
    n = int(float(m[1]) * _UNITS[m[2].lower()])
    if n < 1:
        raise ValueError(f"a byte count must be positive, got {value!r}")
    return n


def format_bytes(n: int) -> str:
    """1.5 GiB, 300.0 MiB, 12 KiB: binary units, one decimal above a KiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.0f} KiB" if abs(n) >= 1024 else f"{n} B"
