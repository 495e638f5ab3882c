"""Draft proposals for speculative decoding, made at the driver without a draft model.

The rule is prompt lookup (llama.cpp's ``--lookup`` / prompt-lookup decoding,
vLLM's ``ngram`` proposer, suffix decoding): take the longest suffix of the
request's tokens (prompt, then output), from ``max_match`` tokens down to
``min_match``, find its most recent EARLIER occurrence, and propose the tokens
that followed it. The longest match wins over a shorter, more recent one.
The continuation is read from the token list as if the drafts were already
appended, so a match that runs into the current end repeats its period:
``a b a b a b`` proposes ``a b a b ...`` (the earlier ``a b a b`` ends two
tokens back; its continuation is the suffix itself, then the drafts).

When the request's own tokens have no match, a ``SharedIndex`` of recent
outputs across requests is tried (suffix decoding's global tree, kept small:
a bounded window of whole sequences).

Both indexes key every n-gram (``min_match <= n <= max_match``) by one packed
integer built token by token from the end backwards, mapped to the latest end
position seen, so an appended token and a lookup each cost O(max_match) dict
operations.

``DraftPolicy`` sizes each window per session from how the target verified the
previous ones (see its docstring). Pure Python: no jax, no zmq.
"""

from __future__ import annotations

from collections import deque

from typing import Callable, Iterable, Sequence

from skippy_zmq.config.speculative import SpeculativeConfig

_TOKEN_BITS = 32   # a packed n-gram holds token + 1 in 32 bits per position
_MAX_TOKEN = (1 << 31) - 1


def _checked(tokens: Iterable[int]) -> list[int]:
    out = [int(t) for t in tokens]
    for t in out:
        if not 0 <= t <= _MAX_TOKEN:
            raise ValueError(f"token ids must lie in 0..{_MAX_TOKEN}, got {t}")
    return out


class _GramIndex:
    """Packed n-gram (min..max tokens, read backwards from its end) -> latest end stamp recorded."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match, self.max_match = min_match, max_match
        self._last: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._last)

    def _keys(self, tokens: Sequence[int], end: int, floor: int) -> list[int]:
        """The grams ending at index `end` (exclusive) that start at or after `floor`, shortest first."""
        key, keys = 0, []
        for n in range(1, min(self.max_match, end - floor) + 1):
            key = (key << _TOKEN_BITS) | (tokens[end - n] + 1)
            if n >= self.min_match:
                keys.append(key)
        return keys

    def record(self, tokens: Sequence[int], end: int, floor: int, stamp: int) -> None:
        for key in self._keys(tokens, end, floor):
            self._last[key] = stamp

    def forget(self, tokens: Sequence[int], end: int, floor: int, stamp: int) -> None:
        """Drop the grams `record` noted with `stamp`, unless a later occurrence replaced them."""
        for key in self._keys(tokens, end, floor):
            if self._last.get(key) == stamp:
                del self._last[key]

    def matches(self, tokens: Sequence[int], end: int) -> list[int]:
        """Stamps of the grams ending at `end`, from min_match tokens long up to the longest one known."""
        key, found = 0, []
        for n in range(1, min(self.max_match, end) + 1):
            key = (key << _TOKEN_BITS) | (tokens[end - n] + 1)
            if n >= self.min_match:
                stamp = self._last.get(key)
                if stamp is None:  # a longer gram holds this one as its suffix: none is known either
                    break
                found.append(stamp)
        return found


class NgramProposer:
    """Longest-suffix lookup over one request's tokens (prompt, then output)."""

    def __init__(self, cfg: SpeculativeConfig, tokens: Iterable[int] = ()):
        self.cfg = cfg
        self._tokens: list[int] = []
        self._index = _GramIndex(cfg.min_match, cfg.max_match)
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def tail(self) -> list[int]:
        """The last max_match tokens: all a suffix lookup elsewhere (SharedIndex) needs."""
        return self._tokens[-self.cfg.max_match:]

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens; the grams ending before each new token become findable."""
        toks, index = self._tokens, self._index
        for t in _checked(tokens):
            # The grams ending at the current end get a continuation (t) now; the suffix
            # ending at the new end stays unrecorded, so a lookup only finds earlier ones.
            index.record(toks, len(toks), 0, len(toks))
            toks.append(t)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (a rewound session); rebuilds the index."""
        if n < len(self._tokens):
            kept = self._tokens[:max(n, 0)]
            self._tokens, self._index = [], _GramIndex(self.cfg.min_match, self.cfg.max_match)
            self.extend(kept)

    def propose(self, k: int, assumed: Sequence[int] = ()) -> list[int]:
        """The k tokens that followed the latest earlier occurrence of the longest suffix; [] if none.

        Always k on a match: where the occurrence's continuation runs into the current end,
        the drafts so far are read in its place (the match's period repeats). `assumed`: tokens
        taken as following the kept ones for this lookup only (windows still in flight).
        """
        toks = self._tokens + list(assumed) if assumed else self._tokens
        found = self._index.matches(toks, len(toks)) if k > 0 else []
        if not found:
            return []
        start, end, out = found[-1], len(toks), []
        for j in range(k):
            i = start + j
            out.append(toks[i] if i < end else out[i - end])
        return out


class SharedIndex:
    """Recent output sequences across requests, the oldest forgotten beyond `shared_tokens` in all.

    Sequences sit in one flat list, each followed by a -1 separator; stamps are
    absolute positions (`_base` is the absolute position of `_flat[0]`). An
    evicted sequence takes out of the index every gram whose latest occurrence
    it held (O(max_match) a token, like adding it), so the index only knows
    kept tokens; the flat list drops its dead prefix once that exceeds a
    quarter of the bound.
    """

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self._flat: list[int] = []
        self._base = 0
        self._seqs: deque[tuple[int, int]] = deque()   # (absolute start, length) of each kept sequence
        self._kept = 0                                  # tokens in _seqs
        self._index = _GramIndex(cfg.min_match, cfg.max_match)

    @property
    def tokens(self) -> int:
        """Tokens currently remembered (at most shared_tokens)."""
        return self._kept

    def add(self, tokens: Iterable[int]) -> None:
        """Remember one finished sequence (only its last shared_tokens tokens when longer)."""
        seq = _checked(tokens)[-self.cfg.shared_tokens:]
        if len(seq) <= self.cfg.min_match:  # no gram with a continuation
            return
        start = self._base + len(self._flat)
        self._flat.extend(seq)
        self._flat.append(-1)
        self._seqs.append((start, len(seq)))
        self._kept += len(seq)
        self._walk(start, len(seq), self._index.record)
        while self._kept > self.cfg.shared_tokens:
            old, length = self._seqs.popleft()
            self._kept -= length
            self._walk(old, length, self._index.forget)
        dead = self._seqs[0][0] - self._base
        if dead > self.cfg.shared_tokens // 4:
            del self._flat[:dead]
            self._base += dead

    def propose(self, context_tail: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest kept occurrence of the longest suffix of `context_tail`."""
        tail = _checked(context_tail[-self.cfg.max_match:])
        if k <= 0:
            return []
        found = self._index.matches(tail, len(tail))
        if not found:
            return []
        out, i = [], found[-1] - self._base
        while len(out) < k and self._flat[i] >= 0:   # up to the separator: no reading into the next sequence
            out.append(self._flat[i])
            i += 1
        return out

    def _walk(self, start: int, length: int, note: Callable[[Sequence[int], int, int, int], None]) -> None:
        """Call `note` for each gram of one sequence that has at least one token after it."""
        lo = start - self._base
        for end in range(lo + 1, lo + length):
            note(self._flat, end, lo, end + self._base)


def propose_draft(own: NgramProposer, shared: SharedIndex | None, k: int, assumed: Sequence[int] = ()) -> list[int]:
    """The request's own lookup first, then the shared index (when there is one); `assumed` as in
    NgramProposer.propose."""
    draft = own.propose(k, assumed)
    if not draft and shared is not None:
        draft = shared.propose((own.tail() + list(assumed))[-own.cfg.max_match:], k)
    return draft


class DraftPolicy:
    """How many tokens one session drafts next (`k`; 0 = plain decoding).

    Rule, after each verified window (`update(drafted, accepted)`):

    * all drafts accepted: k doubles, up to max_draft (a pipeline verifies a
      short window for about the cost of one decode step, so grow fast);
    * a draft rejected: k = max(min_draft, accepted + 1, k // 2): at least the
      length that would just have covered this window's accepted run plus one,
      but never below half the last window (one divergence in a copied passage
      is usually followed by long accepted runs again; halving instead of
      collapsing measured +5% tokens/s on copy and on chat prompts);
    * an exponential moving average of accepted / drafted (weight 1/8) is
      kept; once it has been below min_acceptance for 8 windows in a row the
      session stops drafting (k = 0);
    * a stopped session counts plain decode steps (`on_plain_step`); after
      probe_every of them it drafts one probe window of max(min_draft, 2)
      tokens. A probe at or above min_acceptance resumes drafting with a fresh
      average; one below stops again and the count restarts.

    A window starts at `cfg.first_draft`: max(min_draft, max_draft // 2). `no_draft_proposal()`
    notes a step where k > 0 but the proposer found nothing: it is counted
    (`empty`) and changes nothing else, since a miss says nothing about how
    well drafts verify and a lookup costs little.
    """

    EMA_WEIGHT = 1 / 8
    STOP_AFTER = 8   # windows in a row below min_acceptance

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.windows = self.drafted = self.accepted = self.empty = 0
        self.ema: float | None = None
        self._k = cfg.first_draft if cfg.enabled else 0
        self._low = 0            # consecutive windows with the average below min_acceptance
        self._stopped = False
        self._probing = False
        self._plain = 0          # plain steps since the session stopped (or last probed)
        self.plain_run = 0       # plain steps since the last verified window (a run on is as long: row_planner)

    @property
    def k(self) -> int:
        return self._k

    @property
    def stopped(self) -> bool:
        return self._stopped and not self._probing

    @property
    def acceptance(self) -> float:
        """Accepted / drafted over the session's whole life (0 before any window)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def update(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted or drafted < 1:
            raise ValueError(f"need 0 <= accepted <= drafted and drafted >= 1, got {accepted} of {drafted}")
        self.windows += 1
        self.plain_run = 0
        self.drafted += drafted
        self.accepted += accepted
        rate = accepted / drafted
        if self._stopped:  # a probe window (or one drafted anyway while stopped)
            self._probing = False
            if rate < self.cfg.min_acceptance:
                self._stop()
                return
            self._stopped, self.ema, self._low = False, None, 0
        self.ema = rate if self.ema is None else self.ema + self.EMA_WEIGHT * (rate - self.ema)
        self._low = self._low + 1 if self.ema < self.cfg.min_acceptance else 0
        if self._low >= self.STOP_AFTER:
            self._stop()
        elif accepted == drafted:
            self._k = min(self.cfg.max_draft, 2 * self._k)
        else:
            self._k = max(self.cfg.min_draft, accepted + 1, self._k // 2)

    def on_plain_step(self) -> None:
        """One decode step without drafts; a stopped session probes after probe_every of them."""
        self.plain_run += 1
        if self._stopped and not self._probing:
            self._plain += 1
            if self._plain >= self.cfg.probe_every:
                self._probing, self._plain = True, 0
                self._k = min(self.cfg.max_draft, max(self.cfg.min_draft, 2))

    def no_draft_proposal(self) -> None:
        self.empty += 1

    def _stop(self) -> None:
        self._stopped, self._probing, self._plain, self._k = True, False, 0, 0


def window_len(k: int, room: int, buckets: Sequence[int], widest: int) -> int:
    """Tokens in the next verify window (the current token, then drafts): the largest bucket of at
    most k + 1 tokens, `room` tokens (no draft runs past max_tokens or the context, so no position
    is wasted on a token that cannot be kept) and `widest` (what its DECODE can carry); 1 (no
    drafts) when no bucket fits. Rows pad to a bucket, so a window drafts a bucket minus one."""
    return max([n for n in buckets if n <= min(min(k, room - 1) + 1, widest)] or [1])


class Drafter:
    """One stream's speculation: its n-gram proposer and draft policy, and the three steps every
    caller takes (size and propose a window, propose a window ahead, judge a verified window)."""

    def __init__(self, cfg: SpeculativeConfig, prompt: Iterable[int] = (), shared: SharedIndex | None = None):
        self.cfg, self.shared = cfg, shared
        self.proposer = NgramProposer(cfg, prompt)
        self.policy = DraftPolicy(cfg)

    def window(self, room: int, buckets: Sequence[int], widest: int) -> int:
        return window_len(min(self.policy.k, self.cfg.max_draft), room, buckets, widest)

    def drafts(self, room: int, buckets: Sequence[int], widest: int) -> list[int]:
        """The drafts of the next window (after the current token); [] for a plain step."""
        fits = self.window(room, buckets, widest)
        if fits <= 1:
            return []
        drafts = propose_draft(self.proposer, self.shared, fits - 1)
        if not drafts:
            self.policy.no_draft_proposal()
        return drafts

    def proposes(self, room: int, buckets: Sequence[int], widest: int) -> bool:
        """Whether the next window would carry drafts, asking nothing of the policy (a stage running
        on from its own samples is cut short for it)."""
        fits = self.window(room, buckets, widest)
        return fits > 1 and bool(propose_draft(self.proposer, self.shared, fits - 1))

    def ahead(self, room: int, buckets: Sequence[int], widest: int, assumed: Sequence[int]) -> list[int]:
        """A window to send ahead, as if `assumed` (the windows in flight) were all accepted: the guess
        of the last one's bonus token, then drafts; [] when there is no room or no proposal."""
        fits = self.window(room, buckets, widest)
        row = propose_draft(self.proposer, self.shared, fits, assumed) if fits > 1 else []
        return row if len(row) >= 2 else []

    def judge(self, drafts: Sequence[int], targets: Sequence[int]) -> tuple[list[int], int]:
        return judge_window(self.policy, drafts, targets)

    def accepted(self, tokens: Iterable[int]) -> None:
        self.proposer.extend(tokens)

    def stats(self) -> dict[str, int]:
        p = self.policy
        return {"windows": p.windows, "drafted": p.drafted, "accepted": p.accepted}


def judge_window(policy: DraftPolicy | None, drafts: Sequence[int], targets: Sequence[int]) -> tuple[list[int], int]:
    """accepted_run, with the session's draft policy told what happened: a verified window
    (`update`) or a plain step (`on_plain_step`, so a policy that stopped drafting probes again).
    The one accept step of the scheduler and of single-process generation."""
    run, accepted = accepted_run(drafts, targets)
    if policy is not None:
        if drafts:
            policy.update(len(drafts), accepted)
        else:
            policy.on_plain_step()
    return run, accepted


def accepted_run(drafts: Sequence[int], targets: Sequence[int]) -> tuple[list[int], int]:
    """What a verified window yields: the target's tokens while they match the drafts, then the
    target's own next token; and how many drafts were accepted.

    targets[j] is the target's token after the window's first j + 1 inputs (the current token,
    then drafts[:j]), so targets has one more entry than drafts.
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"a window of {len(drafts)} drafts needs {len(drafts) + 1} target tokens, "
                         f"got {len(targets)}")
    accepted = 0
    while accepted < len(drafts) and targets[accepted] == drafts[accepted]:
        accepted += 1
    return [int(t) for t in targets[:accepted + 1]], accepted
