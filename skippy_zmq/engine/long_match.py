"""The `suffix` drafter: prompt lookup that follows one match for as long as it holds, and sizes each
window by how long that match already is.

Learnt from llama.cpp's ``ngram-mod`` (common/ngram-mod.cpp), which drafts only after its last 24
tokens occurred before and then drafts 48 to 64 tokens at once: a long copy is best drafted in long
windows, and a long agreement so far is what predicts one. Its blind spot is the other side: after
one changed token (a type hint added to a copied line) it drafts nothing until 24 tokens agree again.
`MatchProposer` keeps both:

* the match: (src, length), where ``tokens[src - length:src]`` equals the last ``length`` tokens and
  ``tokens[src:]`` is the continuation proposed. Every accepted token equal to ``tokens[src]`` moves
  the match on (length + 1), so a copy of any length is followed in O(1) a token, past the index's
  max_match; a token that differs drops it, and the next lookup finds a new one from the n-gram
  index (min_match..max_match tokens, as the `ngram` drafter) and measures it backwards, so drafting
  resumes min_match tokens after a change instead of 24;
* the size: `match_drafts` turns the match's length into a draft count: a match of `long_match`
  tokens or more drafts the widest window at once (the copy has held that long; the window policy's
  doubling from 7 would waste the first windows of every resumed copy), a shorter one drafts what the
  window policy allows, and never more than one token past its own length (a two-token match is a
  guess; replayed on the bench's copy and chat answers, `length + 1` wasted the fewest positions).

Pure Python, like engine/speculative.py: tokens in, drafts out.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from skippy_zmq.config.speculative import SpeculativeConfig
from skippy_zmq.engine.speculative import Drafter, NgramProposer, SharedIndex, window_len

MEASURE_CAP = 256   # how far back a new match's length is measured (longer ones count as this long)


def match_drafts(length: int, k: int, long_match: int, max_draft: int) -> int:
    """Drafts for a match `length` tokens long when the window policy allows `k`: max_draft once the
    match is long_match tokens or longer, else min(k, length + 1); 0 without a match."""
    if length <= 0:
        return 0
    if length >= long_match:
        return max_draft
    return min(k, length + 1)


class MatchProposer(NgramProposer):
    """NgramProposer that tracks its current match (see the module docstring)."""

    def __init__(self, cfg: SpeculativeConfig, tokens: Iterable[int] = ()):
        self._src, self._len = 0, 0          # no match yet
        super().__init__(cfg, tokens)

    @property
    def match_len(self) -> int:
        """Tokens the current match agrees on (0: none)."""
        return self._len

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens, moving the match on while they continue it and looking a new one up after
        every token that does not (so the match found never depends on when proposals were asked)."""
        toks = list(tokens)
        for i, t in enumerate(toks):
            held = self._len and self._tokens[self._src] == t
            super().extend(toks[i:i + 1])
            if held:
                self._src, self._len = self._src + 1, self._len + 1
            else:
                self._src, self._len = self._lookup(self._tokens)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens; the match is looked up again from scratch (NgramProposer.truncate
        rebuilds by extend)."""
        if n < len(self._tokens):
            self._src, self._len = 0, 0
        super().truncate(n)

    def propose(self, k: int, assumed: Sequence[int] = ()) -> list[int]:
        """k tokens from the match's continuation (the drafts themselves where it runs into the end);
        [] without a match. `assumed`: tokens taken as following the kept ones, this lookup only."""
        if k <= 0:
            return []
        if assumed:
            toks = self._tokens + list(assumed)
            src, length = self._lookup(toks)
        else:
            toks, src, length = self._tokens, self._src, self._len
        if not length:
            return []
        end, out = len(toks), []
        for j in range(k):
            i = src + j
            out.append(toks[i] if i < end else out[i - end])
        return out

    def _lookup(self, toks: Sequence[int]) -> tuple[int, int]:
        """The latest earlier occurrence of the longest indexed suffix, and its length measured
        backwards (up to MEASURE_CAP); (0, 0) without one."""
        found = self._index.matches(toks, len(toks))
        if not found:
            return 0, 0
        src, end, n = found[-1], len(toks), self.cfg.min_match + len(found) - 1
        while n < min(src, MEASURE_CAP) and toks[src - n - 1] == toks[end - n - 1]:
            n += 1
        return src, n


class MatchDrafter(Drafter):
    """Drafter over a MatchProposer: windows sized by `match_drafts`, the shared index as fallback."""

    def __init__(self, cfg: SpeculativeConfig, prompt: Iterable[int] = (), shared: SharedIndex | None = None):
        super().__init__(cfg, (), shared)
        self.proposer = MatchProposer(cfg, prompt)

    def _k(self) -> int:
        k = min(self.policy.k, self.cfg.max_draft)
        if k <= 0:
            return 0
        length = self.proposer.match_len
        if not length:   # the shared index may still find one: the policy's size
            return k
        return match_drafts(length, k, self.cfg.long_match, self.cfg.max_draft)

    def window(self, room: int, buckets: Sequence[int], widest: int) -> int:
        return window_len(self._k(), room, buckets, widest)


def make_drafter(cfg: SpeculativeConfig, prompt: Iterable[int] = (), shared: SharedIndex | None = None) -> Drafter:
    """The drafter `cfg.method` names: `suffix` (MatchDrafter) or `ngram` (Drafter)."""
    kind = MatchDrafter if cfg.method == "suffix" else Drafter
    return kind(cfg, prompt, shared)
