"""A stage's prefix store settings: the topology's per-stage `cache` section and what
kv/prefix_store.py runs on, one frozen dataclass with one set of defaults."""

from __future__ import annotations

from dataclasses import dataclass

CACHE_MODES = ("disabled", "record", "lookup-record")


@dataclass(frozen=True)
class CacheConfig:
    mode: str = "lookup-record"        # disabled | record (store, never look up) | lookup-record
    max_bytes: int = 256 << 20         # the store's byte budget (LRU beyond it)
    max_entries: int = 256
    stride: int = 128                  # grid prefixes at stride, 2 * stride, ... are stored beside the exact one
    min_tokens: int = 64               # nothing shorter is stored
    max_grid_entries_per_record: int = 4   # a few grid entries per prompt, the longest kept

    def __post_init__(self) -> None:
        # The topology's loader checks each key with its name first; this guards direct construction.
        if self.mode not in CACHE_MODES:
            raise ValueError(f"prefix store mode must be one of {CACHE_MODES}, got {self.mode!r}")
        for name in ("max_bytes", "max_grid_entries_per_record"):
            if getattr(self, name) < 0:
                raise ValueError(f"prefix store {name} must be >= 0")
        for name in ("max_entries", "stride", "min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"prefix store {name} must be >= 1")

    @property
    def lookup(self) -> bool:
        return self.mode == "lookup-record"

    @property
    def record(self) -> bool:
        return self.mode != "disabled"
