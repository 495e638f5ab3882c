"""A sequence's tokens by absolute position (TokenHistory) and the token counts penalties read
(_Counts): truncate / put by position, so a rejected speculative tail or a resume is one call."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _Counts:
    """token -> count, with index arrays for numpy built on first use.

    The dict is the source of truth. The arrays (distinct ids, float32 counts
    aligned with them) are only built when penalties first ask for them, so a
    request that never applies penalties never builds them; after that they are
    kept up to date in O(1) per token (append into a doubling buffer, count
    increment, or swap-remove when a count reaches zero), never rebuilt.
    """

    __slots__ = ("counts", "_ids", "_vals", "_slot", "_n")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._slot: dict[int, int] | None = None  # None: arrays not built yet
        self._ids = np.empty(0, np.int64)
        self._vals = np.empty(0, np.float32)
        self._n = 0

    def add(self, token: int) -> None:
        c = self.counts.get(token, 0)
        self.counts[token] = c + 1
        slot = self._slot
        if slot is None:
            return
        if c:
            self._vals[slot[token]] += 1.0
            return
        n = self._n
        if n == self._ids.size:
            size = max(16, 2 * n)
            self._ids = np.resize(self._ids, size)
            self._vals = np.resize(self._vals, size)
        self._ids[n] = token
        self._vals[n] = 1.0
        slot[token] = n
        self._n = n + 1

    def remove(self, token: int) -> None:
        c = self.counts[token] - 1
        slot = self._slot
        if c:
            self.counts[token] = c
            if slot is not None:
                self._vals[slot[token]] -= 1.0
            return
        del self.counts[token]
        if slot is None:
            return
        i, last = slot.pop(token), self._n - 1
        if i != last:  # move the last entry into the hole
            moved = int(self._ids[last])
            self._ids[i] = moved
            self._vals[i] = self._vals[last]
            slot[moved] = i
        self._n = last

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct ids int64, counts float32): views valid until the next change."""
        if self._slot is None:
            n = len(self.counts)
            self._ids = np.fromiter(self.counts.keys(), np.int64, n)
            self._vals = np.fromiter(self.counts.values(), np.float32, n)
            self._slot = {t: i for i, t in enumerate(self.counts)}
            self._n = n
        return self._ids[: self._n], self._vals[: self._n]


class TokenHistory:
    """A sequence's tokens by absolute position, ready for penalties.

    The prompt occupies positions [0, P); tokens recorded at positions >= P
    are "generated". Repetition penalty covers prompt + generated
    (``seen_ids``); presence/frequency cover generated only
    (``generated_ids`` / ``generated_counts``). Generated tokens can be
    forgotten from any position on (``truncate``) or overwritten (``put``),
    which is what a rejected speculative tail needs.
    """

    def __init__(self, prompt_ids: Sequence[int] = (), generated: Sequence[int] = ()) -> None:
        self.prompt: list[int] = int_list(prompt_ids)
        self.generated: list[int] = []  # tokens at positions P, P+1, ...
        self._generated = _Counts()
        self._seen = _Counts()
        for token in self.prompt:
            self._seen.add(token)
        self.put(len(self.prompt), generated)

    @property
    def length(self) -> int:
        """Positions held: the prompt plus the generated tokens held."""
        return len(self.prompt) + len(self.generated)

    @property
    def seen_ids(self) -> np.ndarray:
        """Distinct tokens in prompt + generated (int64, no particular order)."""
        return self._seen.arrays()[0]

    @property
    def generated_ids(self) -> np.ndarray:
        """Distinct generated tokens (int64), aligned with ``generated_counts``."""
        return self._generated.arrays()[0]

    @property
    def generated_counts(self) -> np.ndarray:
        return self._generated.arrays()[1]

    def truncate(self, length: int) -> None:
        """Forget generated tokens at positions >= length (never the prompt)."""
        keep = max(0, int(length) - len(self.prompt))
        gen = self.generated
        if keep >= len(gen):
            return
        for token in gen[keep:]:
            self._generated.remove(token)
            self._seen.remove(token)
        del gen[keep:]

    def put(self, position: int, tokens: Sequence[int]) -> None:
        """truncate(position), then record tokens at position, position+1, ...

        Tokens that land on the prompt's positions are ignored (the prompt is
        already held). Tokens equal to those already held at the same
        positions are kept rather than removed and re-added, so re-putting a
        window's current token costs nothing.
        """
        position = int(position)
        if position < 0 or position > self.length:
            raise ValueError(f"put at position {position} needs 0 <= position <= {self.length}, "
                             f"the positions the history holds (no gaps)")
        tokens = int_list(tokens)
        p = len(self.prompt)
        if position < p:
            tokens = tokens[p - position :]
            position = p
        gen, off = self.generated, position - p
        same, limit = 0, min(len(tokens), len(gen) - off)
        while same < limit and gen[off + same] == tokens[same]:
            same += 1
        self.truncate(position + same)
        for token in tokens[same:]:
            gen.append(token)
            self._generated.add(token)
            self._seen.add(token)

    def prefix(self, length: int) -> TokenHistory:
        """A new history of positions [0, length) only (slow path; copies)."""
        length = max(0, int(length))
        p = len(self.prompt)
        return TokenHistory(self.prompt[:length], self.generated[: max(0, length - p)])


def int_list(tokens: Sequence[int] | np.ndarray) -> list[int]:
    """Token ids as a flat list of Python ints (from a sequence or an array of any shape)."""
    if isinstance(tokens, np.ndarray):
        return tokens.reshape(-1).tolist()
    return [int(t) for t in tokens]
