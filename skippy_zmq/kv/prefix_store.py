"""Host-side prefix store: KV blocks of already-seen prompt prefixes, per stage.

Each stage holds KV only for its own layer range, so each stage keeps its own
store and keys it by (model digest, layer range, KV dtype, namespace, token ids).
A repeated prompt prefix is then restored instead of recomputed.

Besides the exact prompt, `record` stores a stride grid (prefixes of length
stride, 2*stride, ...) so two prompts that share only a system prompt still hit.
Lookups are exact (`lookup` of one token prefix): the driver's prefix index
predicts with `recorded_lengths` which prefix a stage holds and asks for that
one. Eviction is LRU under a byte budget and an entry cap, on insert.

Thread-safety: none here. A stage records on a background thread and looks up
on its loop thread, so it reaches the store only through stage/recorder.py's
lock. Numpy only: no JAX, no zmq.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from skippy_zmq.config.cache import CacheConfig

_DIGEST_SIZE = 16
DEFAULT_NAMESPACE = "default"   # the key namespace of a request without a prompt_cache_key


@dataclass(frozen=True)
class StoreIdentity:
    """What makes KV blocks interchangeable: same weights, same layers, same dtype."""

    model_digest: str
    layer_start: int
    layer_end: int
    kv_dtype: str


@dataclass(frozen=True)
class Entry:
    key: bytes
    namespace: str
    length: int
    k: np.ndarray  # [n_layers_of_stage, length, n_kv_heads, head_dim], read-only
    v: np.ndarray
    nbytes: int


def _lp(text: str) -> bytes:
    # Length-prefixed so ("ab", "c") and ("a", "bc") hash differently.
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4").tobytes()


def _prefix_keys(
    identity: StoreIdentity, namespace: str, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int]
) -> dict[int, bytes]:
    """Keys of tokens[:L] for each L, hashing the shared prefix only once."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(_lp(identity.model_digest))
    h.update(struct.pack("<qq", identity.layer_start, identity.layer_end))
    h.update(_lp(identity.kv_dtype))
    h.update(_lp(namespace))
    raw = _token_bytes(tokens)
    keys: dict[int, bytes] = {}
    done = 0
    for length in sorted(set(lengths)):
        h.update(raw[4 * done : 4 * length])
        done = length
        keys[length] = h.copy().digest()
    return keys


def prefix_key(identity: StoreIdentity, namespace: str, tokens: Sequence[int] | np.ndarray) -> bytes:
    """blake2b of identity + namespace + int32 little-endian token ids."""
    n = len(tokens)
    return _prefix_keys(identity, namespace, tokens, [n])[n]


def _frozen_copy(a: np.ndarray) -> np.ndarray:
    # Own, contiguous, read-only: a slice view would pin the caller's big buffer,
    # and a writable array could be corrupted by whoever restores from it.
    out = np.array(a, copy=True, order="C")
    out.flags.writeable = False
    return out


def grid_lengths(c: CacheConfig, n_tokens: int) -> list[int]:
    """Stride-grid prefix lengths recorded for an n-token prompt, longest first."""
    top = (n_tokens - 1) // c.stride * c.stride  # grid points are strictly shorter than the prompt
    grid = [n for n in range(top, 0, -c.stride) if n >= c.min_tokens]
    return grid[: c.max_grid_entries_per_record]


def recorded_lengths(c: CacheConfig, n_tokens: int) -> list[int]:
    """Every prefix length `record` stores for n tokens (the driver's index predicts with this)."""
    return ([n_tokens] if n_tokens >= c.min_tokens else []) + grid_lengths(c, n_tokens)


class PrefixStore:
    def __init__(self, identity: StoreIdentity, config: CacheConfig) -> None:
        self.identity = identity
        self.config = config
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # LRU first, MRU last
        self._bytes = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "lookups_disabled", "evictions", "records", "refreshes", "rejected_too_large"), 0
        )

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def grid_lengths(self, n_tokens: int) -> list[int]:
        """Stride-grid prefix lengths `record` stores for an n-token prompt, longest first."""
        return grid_lengths(self.config, n_tokens)

    def record(self, namespace: str, tokens: Sequence[int] | np.ndarray, k: np.ndarray, v: np.ndarray) -> list[int]:
        """Store the exact prefix and its stride grid; return the lengths now held (ascending)."""
        if self.config.mode == "disabled":
            return []
        k, v = np.asarray(k), np.asarray(v)
        n = len(tokens)
        if k.ndim != 4 or k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"k and v must be equal 4-D blocks, got {k.shape}/{k.dtype} and {v.shape}/{v.dtype}")
        if k.shape[1] != n:
            raise ValueError(f"KV covers {k.shape[1]} positions but {n} tokens were given")
        lengths = recorded_lengths(self.config, n)
        keys = _prefix_keys(self.identity, namespace, tokens, lengths)
        # Longest first, so the shorter, more widely shared grid entries end up
        # most recently used and outlive the long, prompt-specific ones.
        for length in lengths:
            self._insert(keys[length], namespace, length, k, v)
        return sorted(length for length in lengths if keys[length] in self._entries)

    def lookup(self, namespace: str, tokens: Sequence[int] | np.ndarray) -> Entry | None:
        """Exactly this token prefix, or None."""
        if self.config.mode != "lookup-record":
            self._counts["lookups_disabled"] += 1
            return None
        return self._hit_or_miss([prefix_key(self.identity, namespace, tokens)])

    def clear(self) -> None:
        """Drop every entry; counters are kept (they describe the run, not the contents)."""
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self._bytes, **self._counts}

    def _hit_or_miss(self, keys: Sequence[bytes]) -> Entry | None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._counts["hits"] += 1
                return entry
        self._counts["misses"] += 1
        return None

    def _insert(self, key: bytes, namespace: str, length: int, k: np.ndarray, v: np.ndarray) -> None:
        if key in self._entries:  # same identity + tokens means same KV: no copy needed
            self._entries.move_to_end(key)
            self._counts["refreshes"] += 1
            return
        k_view, v_view = k[:, :length], v[:, :length]
        nbytes = k_view.nbytes + v_view.nbytes
        if nbytes > self.config.max_bytes:  # could never fit: do not evict others for it
            self._counts["rejected_too_large"] += 1
            return
        while self._entries and (
            self._bytes + nbytes > self.config.max_bytes or len(self._entries) >= self.config.max_entries
        ):
            self._evict_oldest()
        self._entries[key] = Entry(key, namespace, length, _frozen_copy(k_view), _frozen_copy(v_view), nbytes)
        self._bytes += nbytes
        self._counts["records"] += 1

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.nbytes
        self._counts["evictions"] += 1
