"""Host-side token sampling: numpy only, one token per call per sequence.

Order of operations (as in OpenAI / vLLM): logit bias -> repetition penalty
-> presence/frequency penalties -> greedy argmax or temperature -> top-k ->
top-p -> min-p -> draw. Work over the full vocabulary is kept to a couple of
vectorised passes; anything sorted is only the surviving candidates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Top-p first looks for the nucleus among the best few hundred / few thousand
# tokens (argpartition, O(vocab)) and only falls back to sorting everything.
_NUCLEUS_PROBES = (512, 4096)
_DRAW_BLOCK = 256
_BIAS_LIMIT = 100.0


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


class TokenHistory:
    """Tokens a sequence has seen, kept as index arrays ready for penalties.

    Updated per token in O(distinct tokens) memcpy at worst, so sampling never
    rebuilds arrays from Python containers.
    """

    def __init__(self, prompt_ids: Sequence[int] = (), generated: Sequence[int] = ()) -> None:
        self.seen_ids = np.unique(np.asarray(prompt_ids, dtype=np.int64))  # prompt + generated
        self.generated_ids = np.empty(0, np.int64)  # distinct generated tokens
        self.generated_counts = np.empty(0, np.float32)  # aligned with generated_ids
        self._seen: set[int] = set(self.seen_ids.tolist())
        self._slot: dict[int, int] = {}  # generated token -> index into the arrays
        for token in generated:
            self.add(token)

    def add(self, token: int) -> None:
        if token not in self._seen:
            self._seen.add(token)
            self.seen_ids = np.append(self.seen_ids, token)
        slot = self._slot.get(token)
        if slot is None:
            self._slot[token] = self.generated_ids.size
            self.generated_ids = np.append(self.generated_ids, token)
            self.generated_counts = np.append(self.generated_counts, np.float32(1.0))
        else:
            self.generated_counts[slot] += 1.0


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
        # Always push away from being chosen again, whatever the logit's sign.
        out[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if history.generated_ids.size and (params.presence_penalty or params.frequency_penalty):
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

    One uniform per token keeps seeded streams reproducible. np.cumsum is
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


class Sampler:
    """Samples one sequence's tokens and remembers its history for penalties."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.generated: list[int] = []
        self.history = TokenHistory(prompt_ids)
        self._vocab_checked: int | None = None
        # seed=None draws from OS entropy inside default_rng.
        self._rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray) -> int:
        """Choose the next token from logits [vocab] and record it."""
        token = self._choose(logits)
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        """Record a token chosen elsewhere (forced, or from another sampler)."""
        token = int(token)
        self.generated.append(token)
        self.history.add(token)

    def _choose(self, logits: np.ndarray) -> int:
        params = self.params
        if params.greedy:
            return int(np.argmax(logits))
        if params.has_adjustments:
            if self._vocab_checked != logits.shape[-1]:
                params.validate(logits.shape[-1])
                self._vocab_checked = logits.shape[-1]
            logits = adjust_logits(logits, params, self.history)
        if params.temperature == 0.0:
            return int(np.argmax(logits))
        ids, weights = _filtered_weights(logits, params)
        pick = _draw(weights, self._rng.random())
        return pick if ids is None else int(ids[pick])


def sample_rows(samplers: Sequence[Sampler], logits: np.ndarray) -> np.ndarray:
    """Sample one token per row of logits [rows, vocab], row i with samplers[i]."""
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits shape {logits.shape} does not match {len(samplers)} samplers")
    return np.array([s.sample(row) for s, row in zip(samplers, logits)], dtype=np.int32)
