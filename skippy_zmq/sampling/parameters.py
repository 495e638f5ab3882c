"""Sampling settings: SamplingParams (per request, frozen, validated on construction, its wire
form) and the logprobs count check (check_top_logprobs). Owns what a valid setting is; nothing here
touches logits."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

_BIAS_LIMIT = 100.0
MAX_TOP_LOGPROBS = 20


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


def check_top_logprobs(top_n: object) -> int:
    """top_n as an int in [0, MAX_TOP_LOGPROBS]; ValueError otherwise."""
    if not _is_int(top_n) or not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_n!r}")
    return int(top_n)
