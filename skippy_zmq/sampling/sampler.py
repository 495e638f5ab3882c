"""Sampler: one sequence's sampling state (its history for penalties, its seed and choice index
for the keyed draw, an optional constraint matcher kept in step with the generated tokens) and
the calls the final stage makes: choose / choose_logprobs at a position, sample_window over a
verify window, put / truncate as the sequence's tokens change."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from skippy_zmq.sampling.history import TokenHistory, int_list
from skippy_zmq.sampling.parameters import SamplingParams, check_top_logprobs
from skippy_zmq.sampling.rng import uniform
from skippy_zmq.sampling.transforms import (
    TokenLogprobs,
    adjust_logits,
    draw_candidate,
    mask_logits,
    token_logprobs,
)


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

    ``matcher`` (optional; a ``skippy_zmq.text.constrain.Matcher`` or anything with
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
        return draw_candidate(scored, params, uniform(self.seed, self.choice, position))

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
        tokens = int_list(tokens)
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
        tokens = int_list(tokens)
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
