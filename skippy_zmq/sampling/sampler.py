"""Host-side token sampling: numpy only, one token per position per sequence.

Randomness is keyed by (seed, choice index, absolute position) through
uniform(), and the penalty history is addressed by position (truncate / put),
so a verify window sampled in one go, a rejected tail re-sampled later, and a
resumed session all give the tokens plain step-by-step decoding gives.

Order of operations (as in OpenAI / vLLM): logit bias -> repetition penalty
-> presence/frequency penalties -> greedy argmax or temperature -> top-k ->
top-p -> min-p -> draw. Work over the full vocabulary is kept to a couple of
vectorised passes; anything sorted is only the surviving candidates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Top-p first looks for the nucleus among the best few hundred / few thousand
# tokens (argpartition, O(vocab)) and only falls back to sorting everything.
_NUCLEUS_PROBES = (512, 4096)
_DRAW_BLOCK = 256
_BIAS_LIMIT = 100.0
_F32_MAX = np.float32(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; frozen so they are hashable and shareable."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        # Accept a mapping or pairs; store sorted, clipped pairs so equal
        # settings compare and hash equal.
        raw = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        try:
            pairs = {int(tok): float(bias) for tok, bias in raw}
        except (TypeError, ValueError) as err:
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from err
        clipped = tuple(sorted((t, min(max(b, -_BIAS_LIMIT), _BIAS_LIMIT)) for t, b in pairs.items()))
        object.__setattr__(self, "logit_bias", clipped)
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter."""
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        for tok, bias in self.logit_bias:
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                limit = f" and < {vocab_size}" if vocab_size is not None else ""
                raise ValueError(f"logit_bias token ids must be >= 0{limit}, got {tok}")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite, got {bias} for token {tok}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to a plain argmax of the raw logits."""
        return self.temperature == 0.0 and not self.has_adjustments

    @property
    def has_adjustments(self) -> bool:
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(
            self.presence_penalty or self.frequency_penalty
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        # OpenAI's wire form: {"token id as string": bias}.
        out["logit_bias"] = {str(tok): bias for tok, bias in self.logit_bias}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown SamplingParams keys: {unknown}")
        return cls(**data)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_range(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high  # NaN fails both
    if not ok:
        if high == math.inf:
            raise ValueError(f"{name} must be {'>' if low_open else '>='} {low:g}, got {value!r}")
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijective avalanche mix of a 64-bit int."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, choice: int, position: int) -> float:
    """The uniform in [0, 1) that sampling uses at an absolute position.

    A pure, counter-based function of (seed, choice index, position): the
    draw at a position does not depend on how many draws came before or in
    what order positions were sampled, so speculative windows, re-sampled
    rejected tails and resumes all reproduce the plain decode. Each input is
    folded in through splitmix64's mixer (seeds wider than 64 bits in 64-bit
    chunks); the top 53 bits of the result become the float. About 1 us.
    """
    h = _mix64(_GOLDEN)
    seed = int(seed)
    while True:  # fold every 64-bit chunk of the seed (one chunk for seeds < 2**64)
        h = _mix64((h ^ (seed & _MASK64)) + _GOLDEN & _MASK64)
        seed >>= 64
        if seed <= 0:
            break
    h = _mix64((h ^ (int(choice) & _MASK64)) + _GOLDEN & _MASK64)
    h = _mix64((h ^ (int(position) & _MASK64)) + _GOLDEN & _MASK64)
    return (h >> 11) * (1.0 / (1 << 53))


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
        self.prompt: list[int] = _int_list(prompt_ids)
        self.generated: list[int] = []  # tokens at positions P, P+1, ...
        self._generated = _Counts()
        self._seen = _Counts()
        for token in self.prompt:
            self._seen.add(token)
        self.put(len(self.prompt), generated)

    @property
    def prompt_length(self) -> int:
        return len(self.prompt)

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

    def token_at(self, position: int) -> int:
        p = len(self.prompt)
        return self.prompt[position] if position < p else self.generated[position - p]

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
        tokens = _int_list(tokens)
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

    def add(self, token: int) -> None:
        """Record a token at the next position (put(length, [token]), without the checks)."""
        token = int(token)
        self.generated.append(token)
        self._generated.add(token)
        self._seen.add(token)

    def prefix(self, length: int) -> TokenHistory:
        """A new history of positions [0, length) only (slow path; copies)."""
        length = max(0, int(length))
        p = len(self.prompt)
        return TokenHistory(self.prompt[:length], self.generated[: max(0, length - p)])


def _int_list(tokens: Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(tokens, np.ndarray):
        return tokens.reshape(-1).tolist()
    return [int(t) for t in tokens]


def adjust_logits(logits: np.ndarray, params: SamplingParams, history: TokenHistory | None = None) -> np.ndarray:
    """Return a float32 copy of logits with logit bias and penalties applied.

    Repetition penalty covers prompt + generated tokens (HF/llama.cpp);
    presence/frequency cover generated tokens only (OpenAI). Pure: the input
    is not modified.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if params.logit_bias:
        bias_ids, bias_vals = zip(*params.logit_bias)
        out[list(bias_ids)] += np.asarray(bias_vals, dtype=np.float32)
    if history is None:
        return out
    if params.repetition_penalty != 1.0 and history.seen_ids.size:
        seen = history.seen_ids
        vals = out[seen]
        # Always push away from being chosen again, whatever the logit's sign. A penalty far below 1
        # would overflow a positive logit to +inf (no finite maximum to sample from): clip it to the
        # largest float32 instead, so such a token is simply the most likely.
        # In float64: the penalty itself may not fit a float32 (2.3e-178 would round to 0).
        vals, penalty = vals.astype(np.float64), float(params.repetition_penalty)
        with np.errstate(over="ignore"):
            pushed = np.where(vals > 0, vals / penalty, vals * penalty)
        out[seen] = np.clip(pushed, -_F32_MAX, _F32_MAX)
    if (params.presence_penalty or params.frequency_penalty) and history.generated_ids.size:
        counts = history.generated_counts
        out[history.generated_ids] -= params.presence_penalty + params.frequency_penalty * counts
    return out


def candidate_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids that survive top-k/top-p/min-p and their renormalised probabilities.

    Requires temperature > 0. Ids come back in no particular order.
    """
    ids, weights = _filtered_weights(logits, params)
    probs = weights / weights.sum(dtype=np.float64)
    return (np.arange(logits.shape[-1]) if ids is None else ids), probs


def _filtered_weights(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """Surviving ids (None: the whole vocab, in order) and unnormalised float32 weights."""
    n = logits.shape[-1]
    ids: np.ndarray | None = None
    cand = logits
    if 0 < params.top_k < n:
        ids = np.argpartition(logits, n - params.top_k)[n - params.top_k :]
        cand = logits[ids]
    top = float(cand.max())
    if not math.isfinite(top):
        raise ValueError(f"logits have no finite maximum (max={top})")
    if params.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + T*log(min_p). Renormalising
        # after top-p keeps p_i/p_max, so filtering before top-p gives the same
        # set and shrinks what top-p has to sort.
        keep = np.flatnonzero(cand >= top + params.temperature * math.log(params.min_p))
        ids = keep if ids is None else ids[keep]
        cand = cand[keep]
    # Shifting by the max keeps exp in range, so float32 is enough; one new array.
    weights = np.subtract(cand, top, dtype=np.float32)
    weights *= np.float32(1.0 / params.temperature)
    np.exp(weights, out=weights)
    if params.top_p < 1.0:
        ids, weights = _nucleus(ids, weights, params.top_p)
    return ids, weights


def _nucleus(ids: np.ndarray | None, weights: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Smallest highest-weight prefix whose share of the mass reaches top_p."""
    target = top_p * float(weights.sum(dtype=np.float64))
    pool = None
    for size in _NUCLEUS_PROBES:
        if weights.size <= size:
            break
        probe = np.argpartition(weights, weights.size - size)[-size:]
        if weights[probe].sum(dtype=np.float64) >= target:
            pool = probe  # the nucleus lies inside the probe; sort just that
            break
    if pool is None:
        pool = np.arange(weights.size)
    order = pool[np.argsort(-weights[pool])]
    cut = int(np.searchsorted(np.cumsum(weights[order], dtype=np.float64), target)) + 1
    kept = order[: min(cut, order.size)]
    return (kept if ids is None else ids[kept]), weights[kept]


def _draw(weights: np.ndarray, u: float) -> int:
    """Inverse-CDF pick of an index for a uniform u in [0, 1).

    One uniform per token (see uniform()) keeps seeded sampling reproducible. np.cumsum is
    sequential and slow over a full vocabulary, so find the block first.
    """
    offset, target = 0, u * float(weights.sum(dtype=np.float64))
    if weights.size > _DRAW_BLOCK:
        block_sums = np.add.reduceat(weights, np.arange(0, weights.size, _DRAW_BLOCK), dtype=np.float64)
        block_cdf = np.cumsum(block_sums)
        block = _search(block_cdf, block_sums, target)
        target -= block_cdf[block] - block_sums[block]
        offset = block * _DRAW_BLOCK
        weights = weights[offset : offset + _DRAW_BLOCK]
    return offset + _search(np.cumsum(weights, dtype=np.float64), weights, target)


def _search(cdf: np.ndarray, mass: np.ndarray, target: float) -> int:
    index = int(np.searchsorted(cdf, target, side="right"))
    # Rounding can put target past the end; fall back to the last index with mass.
    return index if index < cdf.size else int(np.flatnonzero(mass)[-1])


MAX_TOP_LOGPROBS = 20


def check_top_logprobs(top_n: object) -> int:
    """top_n as an int in [0, MAX_TOP_LOGPROBS]; ValueError otherwise."""
    if not _is_int(top_n) or not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_n!r}")
    return int(top_n)


TokenLogprobs = tuple[float, list[tuple[int, float]]]   # (log p(token), [(id, log p), ...] highest first)


def token_logprobs(adjusted_logits: np.ndarray, token: int, top_n: int = 0) -> TokenLogprobs:
    """(log p(token), [(id, log p), ...] of the top_n most likely ids) under softmax(adjusted_logits).

    The log-softmax is taken in float64 over the whole vocabulary, of the logits as given (in
    serving: after logit bias, penalties and any constraint mask, before temperature and
    top-k / top-p / min-p). The top list is ordered by logprob, highest first (ties: lower id
    first) and leaves out ids whose logit is -inf (masked: they cannot be chosen), so it can be
    shorter than top_n. A -inf chosen token's logprob is -inf. Pure.
    """
    x = np.asarray(adjusted_logits, dtype=np.float64).reshape(-1)
    top = float(x.max())
    if not math.isfinite(top):
        raise ValueError(f"logits have no finite maximum (max={top})")
    shifted = x - top
    lse = math.log(float(np.exp(shifted).sum()))
    logprob = float(shifted[int(token)] - lse)
    n = min(int(top_n), x.size)
    if n <= 0:
        return logprob, []
    ids = np.argpartition(shifted, x.size - n)[x.size - n:] if n < x.size else np.arange(x.size)
    ids = ids[np.lexsort((ids, -shifted[ids]))]
    return logprob, [(int(i), float(shifted[i] - lse)) for i in ids if shifted[i] != -math.inf]


class Sampler:
    """Samples one sequence's tokens; remembers its history for penalties.

    Randomness is keyed, not streamed: the token chosen from the logits at
    absolute position p uses ``uniform(seed, choice, p)``, and penalties use
    the history held through p. So a position gives the same token whether it
    is sampled step by step, inside a speculative verify window, re-sampled
    after a rejected tail, or after a resume.

    ``seed`` is ``params.seed`` or, when that is None, a random 63-bit seed
    drawn once here. A driver that wants resumes (or any re-run) to reproduce
    should fill in ``params.seed`` before configuring the stage, since a
    resumed stage builds a new Sampler. ``choice`` is the index of the
    completion within a request (OpenAI's n): each gets its own stream.

    Positions: ``history`` holds the input token at each position (prompt at
    [0, P)); the logits at position p predict the token at p + 1.

    ``matcher`` (optional; a ``skippy_zmq.constrain.Matcher`` or anything with
    its ``allows / advance / rollback / mask / apply``) constrains the output:
    it follows the generated tokens exactly as the penalty history does (the
    generated tokens are its input), and ``choose`` at position p masks the
    (adjusted) logits with its mask for the state after the generated tokens
    through p. It is synced lazily, in ``choose``: ``put`` and ``truncate`` only
    note the first generated index that changed, so a window put by the
    session and then walked by ``sample_window`` advances it once per token
    and computes one mask per position. A generated token the matcher refuses
    stops it there (``refused_at``): in a verify window such a draft cannot be
    what the target chose at the position before it (that choice was masked),
    so the driver rejects the window there, and outputs at later positions,
    sampled unmasked, are never used. Without a matcher nothing here changes.

    ``logprobs`` (None, or 0..20 alternatives): what the final stage reports
    with each token. ``scored`` gives the logits ``choose`` picks from at a
    position and ``choose_logprobs`` / ``sample_window_logprobs`` the token
    with ``token_logprobs`` over them; ``choose`` and ``sample_window`` never
    compute them.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), choice: int = 0,
                 matcher: Any = None, logprobs: int | None = None) -> None:
        self.params = params
        # Top alternatives per position to report with each token (0..MAX_TOP_LOGPROBS); None: no logprobs.
        self.logprobs = None if logprobs is None else check_top_logprobs(logprobs)
        self.choice = int(choice)
        self.seed = int(params.seed) if params.seed is not None else secrets.randbits(63)
        self.history = TokenHistory(prompt_ids)
        self._vocab_checked: int | None = None
        self.matcher = matcher
        self._consumed: list[int] = []    # generated tokens the matcher has taken: a prefix of history.generated
        self._dirty = 0                   # generated tokens from this index on may differ from _consumed
        self.refused_at: int | None = None   # generated index of the first token the matcher refused (last sync)
        # Generated index of a verify window's first draft (sample_window); tokens from it on are drafts.
        self._drafts_from = 1 << 62

    @property
    def generated(self) -> list[int]:
        """Tokens held at positions >= P (a copy)."""
        return list(self.history.generated)

    @property
    def length(self) -> int:
        """Positions the history holds: P + generated tokens held."""
        return self.history.length

    def truncate(self, length: int) -> None:
        """Forget generated tokens at positions >= length (never the prompt)."""
        self.history.truncate(length)
        if self.matcher is not None:
            self._dirty = min(self._dirty, max(0, int(length) - len(self.history.prompt)))

    def put(self, position: int, tokens: Sequence[int]) -> None:
        """truncate(position), then record tokens at position, position+1, ...

        Tokens at positions < P are ignored (the prompt is already held).
        Raises ValueError if position > length (a gap).
        """
        self.history.put(position, tokens)
        if self.matcher is not None:
            self._dirty = min(self._dirty, max(0, int(position) - len(self.history.prompt)))

    def _sync(self, count: int) -> bool:
        """Bring the matcher to the state after the first `count` generated tokens; False when
        one of them is refused (the matcher then stands just before it)."""
        matcher, consumed, generated = self.matcher, self._consumed, self.history.generated
        count = min(max(count, 0), len(generated))
        same = min(self._dirty, len(consumed), count)
        while same < min(len(consumed), count) and consumed[same] == generated[same]:
            same += 1
        if same < len(consumed):
            matcher.rollback(len(consumed) - same)
            del consumed[same:]
        self._dirty = 1 << 62
        self.refused_at = None
        while len(consumed) < count:
            token = generated[len(consumed)]
            if not self._takes(token, len(consumed)):
                self.refused_at = len(consumed)
                return False
            consumed.append(token)
        return True

    def _takes(self, token: int, index: int) -> bool:
        """Advance the matcher over generated token `index`; False when it refuses the token. The
        engine failing (ConstraintError) at a state a draft led to refuses that draft too: the
        driver rejects the window there, as plain decoding would never have reached it. At a
        state of accepted tokens only, the failure is the request's and propagates. (A matcher
        fails with ValueError: constrain.ConstraintError is one; constrain imports this module.)"""
        try:
            if not self.matcher.allows(token):
                return False
            self.matcher.advance(token)
        except ValueError:
            if index <= self._drafts_from:   # the state is reached by accepted tokens alone
                raise
            return False
        return True

    def constraint_mask(self, position: int) -> np.ndarray | None:
        """The matcher's mask (bool, vocab) for the token after `position`; None without a
        matcher, or when a generated token through `position` is one it refuses."""
        count = position + 1 - len(self.history.prompt)
        if self.matcher is None or not self._sync(count):
            return None
        try:
            return self.matcher.mask()
        except ValueError:   # a dead end a draft led to: refused there (see _takes)
            if min(count, len(self._consumed)) <= self._drafts_from:
                raise
            self.refused_at = len(self._consumed) - 1
            return None

    def choose(self, logits: np.ndarray, position: int) -> int:
        """The token for position + 1 from logits [vocab] at position; no state change (but a
        matcher's, which only moves to where the history already is).

        Penalties use the history through position (which the history must
        hold: -1 <= position < length; -1 means an empty history) and the draw
        uses uniform(seed, choice, position).
        """
        history = self.history
        length = len(history.prompt) + len(history.generated)
        if not -1 <= position < length:
            raise ValueError(f"choose at position {position} needs -1 <= position < {length}, "
                             f"the positions the history holds")
        params = self.params
        mask = None if self.matcher is None else self.constraint_mask(position)
        if params.greedy and mask is None:
            return int(np.argmax(logits))
        return self._pick(self._scored(logits, position, mask), position)

    def _scored(self, logits: np.ndarray, position: int, mask: np.ndarray | None) -> np.ndarray:
        """The logits `choose` picks from at `position`: logit bias and penalties (history through
        position) applied, then the constraint mask; the input itself (no copy) when neither."""
        params = self.params
        if params.has_adjustments:
            if self._vocab_checked != logits.shape[-1]:
                params.validate(logits.shape[-1])
                self._vocab_checked = logits.shape[-1]
            history = self.history
            if position + 1 < history.length:
                history = history.prefix(position + 1)
            logits = adjust_logits(logits, params, history)   # a copy
            if mask is not None:
                mask_logits(logits, mask)
        elif mask is not None:
            logits = mask_logits(np.array(logits, dtype=np.float32, copy=True), mask)
        return logits

    def _pick(self, scored: np.ndarray, position: int) -> int:
        """Temperature, top-k / top-p / min-p and the keyed draw over already scored logits."""
        params = self.params
        if params.temperature == 0.0:
            return int(np.argmax(scored))
        ids, weights = _filtered_weights(scored, params)
        pick = _draw(weights, uniform(self.seed, self.choice, position))
        return pick if ids is None else int(ids[pick])

    def scored(self, logits: np.ndarray, position: int) -> np.ndarray:
        """The adjusted (and, with a matcher, masked) logits `choose` picks from at `position`, before
        temperature and top-k / top-p / min-p: what logprobs are computed from. Pure like choose."""
        length = self.history.length
        if not -1 <= position < length:
            raise ValueError(f"scored at position {position} needs -1 <= position < {length}, "
                             f"the positions the history holds")
        mask = None if self.matcher is None else self.constraint_mask(position)
        return self._scored(logits, position, mask)

    def choose_logprobs(self, logits: np.ndarray, position: int,
                        top_n: int = 0) -> tuple[int, TokenLogprobs]:
        """choose(logits, position) and token_logprobs of the chosen token over the logits it was
        chosen from (one adjustment pass for both)."""
        scored = self.scored(logits, position)
        token = self._pick(scored, position)
        return token, token_logprobs(scored, token, top_n)

    def sample(self, logits: np.ndarray) -> int:
        """Choose the next token from logits [vocab] at the last held position, and record it."""
        history = self.history
        token = self.choose(logits, len(history.prompt) + len(history.generated) - 1)
        history.add(token)
        return token

    def accept(self, token: int) -> None:
        """Record a token chosen elsewhere (forced, or from another sampler) at the next position."""
        self.history.add(token)

    def sample_window(self, logits: np.ndarray, start: int, tokens: Sequence[int]) -> list[int]:
        """Sample every position of a verify window; returns the token after each.

        logits [T, vocab] are the outputs at positions start .. start+T-1 and
        tokens[j] is the input at start + j (the window's current token, then
        the drafts). Position start + j is sampled with the history through
        start + j, i.e. as if the drafts before it were accepted; the driver
        keeps the longest prefix that matches. Afterwards the history holds
        the window's tokens: length == max(P, start + T). A rejected tail is
        overwritten by the next put / sample_window at its start position.
        """
        if logits.ndim != 2 or logits.shape[0] != len(tokens):
            raise ValueError(f"logits shape {logits.shape} does not match a window of {len(tokens)} tokens")
        tokens = _int_list(tokens)
        start = int(start)
        history = self.history
        out = []
        with self._window(start):
            for j, row in enumerate(logits):
                history.put(start + j, tokens[j : j + 1])
                out.append(self.choose(row, start + j))
        return out

    def sample_window_logprobs(self, logits: np.ndarray, start: int, tokens: Sequence[int],
                               top_n: int | None = None) -> tuple[list[int], list[TokenLogprobs]]:
        """sample_window, plus token_logprobs(scored logits, chosen token, top_n) at every position
        (top_n defaults to self.logprobs, or 0). The same tokens as sample_window, and at each
        position the values a step-by-step `choose_logprobs` gives."""
        if logits.ndim != 2 or logits.shape[0] != len(tokens):
            raise ValueError(f"logits shape {logits.shape} does not match a window of {len(tokens)} tokens")
        top_n = int(self.logprobs or 0) if top_n is None else int(top_n)
        tokens = _int_list(tokens)
        start = int(start)
        history = self.history
        out, entries = [], []
        with self._window(start):
            for j, row in enumerate(logits):
                history.put(start + j, tokens[j : j + 1])
                token, entry = self.choose_logprobs(row, start + j, top_n)
                out.append(token)
                entries.append(entry)
        return out, entries

    @contextlib.contextmanager
    def _window(self, start: int) -> Iterator[None]:
        """Inside: generated tokens past the window's first (at start + 1 on) are drafts."""
        self._drafts_from = start + 1 - len(self.history.prompt)
        try:
            yield
        finally:
            self._drafts_from = 1 << 62


def mask_logits(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Set logits where `mask` is False to -inf, in place; logits past the mask's width (a padded
    vocabulary) too. `mask` broadcasts against `logits`; returns `logits`."""
    width = mask.shape[-1]
    if logits.shape[-1] < width:
        raise ValueError(f"logits width {logits.shape[-1]} < mask width {width}")
    if mask.ndim == 1 and np.count_nonzero(mask) * 16 < width:
        # Few allowed (JSON structure, enums): keep those, fill the rest; twice as fast.
        allowed = np.flatnonzero(mask)
        kept = logits[..., allowed]
        logits[...] = -np.inf
        logits[..., allowed] = kept
        return logits
    logits[..., width:] = -np.inf
    np.copyto(logits[..., :width], -np.inf, where=~mask)
    return logits


def sample_rows(samplers: Sequence[Sampler], logits: np.ndarray) -> np.ndarray:
    """Sample one token per row of logits [rows, vocab], row i with samplers[i]."""
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits shape {logits.shape} does not match {len(samplers)} samplers")
    return np.array([s.sample(row) for s, row in zip(samplers, logits)], dtype=np.int32)
