"""Incarnation fencing: which requests a (possibly replaced) stage may act on.

Invariant, enforced here and nowhere else:

    A stage acts on a request only if the driver that sent it knew this
    stage's current incarnation, and never on a request from an older chain
    view once it has acted on one from a newer view of the same driver.

Why: a stage that dies leaves messages behind that were meant for it: in the
upstream PUSH socket's pipe (ZeroMQ delivers them once the endpoint is bound
again), in the upstream stage's queue, on the wire. Without a fence its
replacement receives them before the driver has re-prefilled the paused
sessions, finds no KV for them and fails the request (`kv_gap`). With it:

- the driver stamps every request with its view of the chain: its own
  incarnation, an epoch that grows whenever a stage incarnation changes, and
  the incarnation it believes each stage has (`ChainView.stamp`);
- a stage drops, counts and logs any request stamped for another incarnation
  of itself, or stamped with an epoch older than one it has already acted on
  (a leftover from a dead upstream peer's pipe arriving after newer work);
- the driver re-prefills a paused session only after every stage said READY,
  and it sends that re-prefill down the same FIFO chain as everything else,
  so on every stage the new view's first message for a session is its
  re-prefill.

With security on (`Fence.required`, set by the stage loop when its links are
CURVE) every request must carry a stamp that names this stage's current
incarnation: an unstamped one, or one that does not name this stage, is
dropped and counted (`unstamped`), so a holder of a legitimate upstream key who
does not know the chain's view cannot get work acted on either. Without
security (tools, tests talking to one stage) unstamped messages are accepted.
This module is pure: no sockets, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from skippy_zmq.protocol.wire import Message

VIEW_KEY = "view"
UNSTAMPED = "unstamped"   # how every reason for dropping an unstamped request starts


@dataclass(frozen=True)
class ChainView:
    """What the driver believes about the chain when it sends a request."""

    driver: int
    epoch: int
    stages: Mapping[str, int]

    def with_stage(self, stage_id: str, incarnation: int) -> "ChainView":
        """The view after `stage_id` announced `incarnation` (a new epoch if that changes anything)."""
        if self.stages.get(stage_id) == incarnation:
            return self
        return ChainView(self.driver, self.epoch + 1, {**self.stages, stage_id: incarnation})

    def stamp(self, msg: Message) -> Message:
        view = {"driver": self.driver, "epoch": self.epoch, "stages": dict(self.stages)}
        return replace(msg, extras={**msg.extras, VIEW_KEY: view})


@dataclass
class Fence:
    """A stage's side of the invariant: `check(msg)` says why a request must be dropped, or None."""

    stage_id: str
    incarnation: int
    newest_epoch: dict[int, int] = field(default_factory=dict)   # driver incarnation -> newest epoch acted on
    dropped: int = 0
    required: bool = False   # security on: a request must carry a stamp naming this stage
    unstamped: int = 0       # requests dropped for want of one (also counted in `dropped`)

    def check(self, msg: Message) -> str | None:
        view = msg.extras.get(VIEW_KEY)
        if view is None:
            return self._drop_unstamped("carries no chain view stamp") if self.required else None
        driver, epoch, stages = _parse(view)
        expected = stages.get(self.stage_id)
        if expected is None and self.required:
            return self._drop_unstamped(f"its chain view stamp does not name {self.stage_id}")
        if expected is not None and expected != self.incarnation:
            return self._drop(f"sent for incarnation {expected:08x} of {self.stage_id}, this is {self.incarnation:08x}")
        newest = self.newest_epoch.get(driver, epoch)
        if epoch < newest:
            return self._drop(f"chain view epoch {epoch} is older than epoch {newest} already served")
        self.newest_epoch[driver] = epoch
        return None

    def _drop(self, reason: str) -> str:
        self.dropped += 1
        return reason

    def _drop_unstamped(self, why: str) -> str:
        self.unstamped += 1
        return self._drop(f"{UNSTAMPED} request: {why} (required when the wire is authenticated)")


class BadView(ValueError):
    """A view stamp that is not {"driver": int, "epoch": int, "stages": {str: int}}."""


def _parse(view: Any) -> tuple[int, int, dict[str, int]]:
    try:
        driver, epoch, stages = view["driver"], view["epoch"], view["stages"]
        ok = all(type(v) is int for v in (driver, epoch)) and isinstance(stages, dict) and \
            all(isinstance(k, str) and type(v) is int for k, v in stages.items())
    except (TypeError, KeyError):
        ok = False
    if not ok:
        raise BadView(f"malformed chain view stamp {str(view)[:120]!r}")
    return driver, epoch, stages
