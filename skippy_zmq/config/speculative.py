"""Driver-side speculation settings (topology `driver.speculative`, `--speculative`, `--max-draft`):
the frozen `SpeculativeConfig` and its checks. The drafter itself is engine/speculative.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

METHODS = ("off", "ngram", "suffix")
MAX_DRAFT_LIMIT = 32
MAX_DEPTH = 16


class SpeculativeConfigError(ValueError):
    """A bad speculative setting; `key` names it (empty when the whole section is wrong)."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"            # off | ngram | suffix (engine/long_match.py)
    max_draft: int = 15            # most drafted tokens per window (1..32); windows pad to 2/4/8/16 tokens
    min_draft: int = 1             # smallest window while drafting
    min_match: int = 2             # shortest suffix n-gram that counts as a match
    max_match: int = 8             # longest suffix tried
    long_match: int = 12           # suffix: a match this long drafts the widest window at once
    shared: bool = True            # fall back to recent outputs of other requests
    shared_tokens: int = 65536     # size bound of that index
    min_acceptance: float = 0.25   # below this (moving average) a session stops drafting
    probe_every: int = 16          # plain decode steps between probes of a stopped session
    depth: int = 0                 # verify windows of one stream in flight at once (0: one per stage; 1: off)

    def override(self, method: str | None = None, max_draft: int | None = None) -> SpeculativeConfig:
        """This config with the command line's --speculative / --max-draft (None: unchanged), checked."""
        raw = self.to_dict()
        raw.update({k: v for k, v in (("method", method), ("max_draft", max_draft)) if v is not None})
        return SpeculativeConfig.from_dict(raw)

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def first_draft(self) -> int:
        """The drafts of a new stream's first window (engine DraftPolicy; the stage's compile order)."""
        return max(self.min_draft, self.max_draft // 2)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SpeculativeConfig:
        """Validate a mapping (YAML ``driver.speculative``); missing keys take the defaults."""
        if not isinstance(raw, Mapping):
            raise SpeculativeConfigError("", f"expected a mapping, got {raw!r}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in raw:
            if key not in allowed:
                raise SpeculativeConfigError(str(key), f"unknown key (allowed: {', '.join(sorted(allowed))})")
        cfg = cls(**raw)
        if cfg.method is False:  # YAML 1.1 (PyYAML) reads a bare `method: off` as false
            cfg = dataclasses.replace(cfg, method="off")
        if cfg.method not in METHODS:
            raise SpeculativeConfigError("method", f"expected one of {', '.join(METHODS)}, got {cfg.method!r}")
        if not isinstance(cfg.shared, bool):
            raise SpeculativeConfigError("shared", f"expected true or false, got {cfg.shared!r}")
        _integer("max_draft", cfg.max_draft, 1, MAX_DRAFT_LIMIT)
        _integer("min_draft", cfg.min_draft, 1, cfg.max_draft, high_is="max_draft")
        _integer("min_match", cfg.min_match, 1)
        _integer("max_match", cfg.max_match, cfg.min_match, low_is="min_match")
        _integer("long_match", cfg.long_match, 1)
        _integer("shared_tokens", cfg.shared_tokens, 1)
        _integer("probe_every", cfg.probe_every, 1)
        _integer("depth", cfg.depth, 0, MAX_DEPTH)
        value = cfg.min_acceptance
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpeculativeConfigError("min_acceptance", f"expected a number, got {value!r}")
        if not 0.0 <= value <= 1.0:
            raise SpeculativeConfigError("min_acceptance", f"must be between 0 and 1, got {value}")
        return dataclasses.replace(cfg, min_acceptance=float(value))


def _integer(key: str, value: Any, low: int, high: int | None = None, low_is: str = "", high_is: str = "") -> None:
    """An int (not a bool) in [low, high]; `low_is` / `high_is` name the setting a bound comes from."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(key, f"expected an integer, got {value!r}")
    if value < low:
        raise SpeculativeConfigError(key, f"must be at least {f'{low_is} ({low})' if low_is else low}, got {value}")
    if high is not None and value > high:
        raise SpeculativeConfigError(key, f"must be at most {f'{high_is} ({high})' if high_is else high}, got {value}")
