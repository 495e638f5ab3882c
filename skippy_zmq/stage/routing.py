"""Pure route tables for the fused restore messages (no JAX, no zmq).

The seed system's TRY_RESTORE_PREFILL(_DECODE) lets each stage look the prefix
up in its own store. A miss anywhere ends the attempt at that stage: it answers
the driver directly and forwards nothing, so the driver falls back to prefill
(positions are absolute, so stages that already restored are overwritten).
Kept as tables so the worker dispatches, and tests enumerate, every row.
"""

from __future__ import annotations

import enum


class Route(enum.Enum):
    DIRECT_MISS = "direct_miss"  # reply ACK(miss) to the driver; forward nothing
    FORWARD_HIT = "forward_hit"  # restored; pass the work downstream; reply nothing
    DIRECT_HIT = "direct_hit"    # restored at the last stage; reply to the driver


# (local_hit, has_downstream) -> route.
# TRY_RESTORE_PREFILL_DECODE: FORWARD_HIT = restore, run current, forward its
# activation; DIRECT_HIT = restore, run, sample, record, reply PREDICTED_TOKENS.
_RESTORE_DECODE_ROUTES: dict[tuple[bool, bool], Route] = {
    (False, False): Route.DIRECT_MISS,
    (False, True): Route.DIRECT_MISS,
    (True, True): Route.FORWARD_HIT,
    (True, False): Route.DIRECT_HIT,
}

# TRY_RESTORE_PREFILL (restore only): FORWARD_HIT = forward the restore
# request; DIRECT_HIT = reply ACK(hit). Same shape, different actions.
_RESTORE_ROUTES: dict[tuple[bool, bool], Route] = dict(_RESTORE_DECODE_ROUTES)


def decide_route(local_hit: bool, has_downstream: bool) -> Route:
    """Route for TRY_RESTORE_PREFILL_DECODE."""
    return _RESTORE_DECODE_ROUTES[(bool(local_hit), bool(has_downstream))]


def decide_restore_route(local_hit: bool, has_downstream: bool) -> Route:
    """Route for TRY_RESTORE_PREFILL (restore without the first decode)."""
    return _RESTORE_ROUTES[(bool(local_hit), bool(has_downstream))]


def check_restore_tokens(n_tokens: int) -> None:
    """The message carries prefix + [current]; a restore needs both parts."""
    if n_tokens < 2:
        raise ValueError(
            "TRY_RESTORE_PREFILL_DECODE needs at least one prefix token plus the current token "
            f"(got {n_tokens} tokens)"
        )
