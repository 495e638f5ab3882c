"""The driver's index of what every stage was asked to record in its prefix store.

The driver never sees KV; it remembers which token prefixes all stages should
hold (the exact recorded prefix plus the stride grid every stage records) and
tries the longest one first. A stage that evicted it turns the try into a
miss, not an error.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from skippy_zmq.config.cache import CacheConfig
from skippy_zmq.kv.prefix_store import recorded_lengths

KEYS_PER_ENTRY = 2   # the index may remember this many prefixes per entry the largest store can hold


def _hash(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, "<i4").tobytes(), digest_size=16).digest()


class PrefixIndex:
    def __init__(self, configs: Sequence[CacheConfig]):
        self.configs = list(configs)
        self.enabled = bool(self.configs) and all(c.mode == "lookup-record" for c in self.configs)
        self.strides = sorted({c.stride for c in self.configs}, reverse=True)
        self._keys: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        # No stage holds more than its max_entries, so older keys could only turn into misses;
        # bounding the index by them keeps the driver's memory flat once the stores are full.
        self.max_keys = KEYS_PER_ENTRY * max((c.max_entries for c in self.configs), default=0)

    def add(self, namespace: str, tokens: Sequence[int]) -> list[int]:
        """Note that every stage recorded `tokens`; returns the lengths all stages should now hold."""
        if not self.enabled:
            return []
        lengths = set.intersection(*(set(recorded_lengths(c, len(tokens))) for c in self.configs))
        for length in lengths:
            key = (namespace, _hash(tokens[:length]))
            self._keys[key] = length
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return sorted(lengths)

    def longest(self, namespace: str, tokens: Sequence[int], max_len: int) -> int:
        """Length of the longest indexed prefix of tokens, at most max_len; 0 if none."""
        if not self.enabled or max_len <= 0:
            return 0
        candidates = {max_len} | {m for s in self.strides for m in range(s, max_len + 1, s)}
        for length in sorted(candidates, reverse=True):
            if self._keys.get((namespace, _hash(tokens[:length]))) == length:
                return length
        return 0
