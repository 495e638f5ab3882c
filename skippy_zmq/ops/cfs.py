"""A host under a CPU quota (a cgroup's `quota_cores` every `period_ms`, Linux CFS bandwidth
control): how long a step of one thread's work takes there when it starts idle (`throttled_ms`,
averaged over where in its period it starts), and how long a token of one stream takes round a
ring of such hosts (`ring_1`), where a step starts in its period is not a matter of chance.

Why the ring is simulated: a host whose step overruns its budget is held until its period ends
and finishes its step just after, at the same point of its period every token; the token then
comes back after the rest of the ring, the same time later each token, so the next step starts
at the same phase again. The phase is locked, and where it lands decides whether the step is
held or not: one layer and the head on a host at 25% of a core (4.5 ms of work against a 3.5 ms
burst) take from 4.5 to 12 ms by phase, 8.1 averaged over phases, and measured 11.1 (bench
cluster, memory-only split). Following the ring token by token finds the phase it locks in.

Why a host's runtime is followed across tokens too: the runtime a core keeps for an idle group
(up to 1 ms) is what the host's previous steps left, not a fresh overrun every step. Given
afresh, a step needing 4.08 periods of budget was held for a fifth every token (50.0 ms
predicted, 41.7 measured: the even split of bench cluster's 23:43 run); carried, a step that
spent it leaves none, and the next is held for a fifth only then (44.8).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

PHASES = 16    # where in its quota period a burst starts: this many points, evenly spread


@functools.lru_cache(maxsize=4096)
def throttled_ms(work_ms: float, quota_cores: float, period_ms: float, first_ms: float = 0.0) -> float:
    """Wall time of `work_ms` of one thread's CPU work under a quota of quota_cores · period_ms
    every period_ms, starting idle at an even spread of phases: CFS runs it until the budget is
    spent, then holds it until the next period refills the budget. `first_ms` (when larger than
    the budget): what a step started idle runs at most before its first stall, the budget and a
    one-time overrun (the runtime the kernel leaves on a core of an idle group), a debt the next
    periods' budgets pay: a short step runs flat out, a long one at the quota. The overrun is
    averaged over an even spread from none to all of it (how much the core kept varies): a step
    that ends just inside it is not counted on to."""
    budget = quota_cores * period_ms
    spread = max(0.0, first_ms - budget)
    extras = [spread * j / (SLACKS - 1) for j in range(SLACKS)] if spread > 0 else [0.0]
    walls = [_throttled_at(work_ms, budget, period_ms, period_ms * (1 - k / PHASES), extra)
             for k in range(PHASES) for extra in extras]
    return sum(walls) / len(walls)


SLACKS = 4     # how much of the overrun a core kept: this many points from none to all


def _throttled_at(work_ms: float, budget: float, period_ms: float, until: float, extra: float) -> float:
    """throttled_ms from one phase (`until` the period ends) and one overrun (`extra`)."""
    left, wall, used, debt = work_ms, 0.0, 0.0, 0.0
    while left > 1e-12:
        allowed = max(0.0, budget - debt)
        ran = min(left, allowed + extra - used, until)
        left, wall, until, used = left - ran, wall + ran, until - ran, used + ran
        if left <= 1e-12:
            break
        if until > 1e-12:          # the budget ran out first: held until the period ends
            wall += until
        over = max(0.0, used - allowed)
        extra, debt, until, used = extra - over, max(0.0, debt - budget) + over, period_ms, 0.0
    return wall


@dataclass(frozen=True)
class Step:
    """One stage's step in a ring: `work_ms` of one thread's CPU work at full speed; under a
    quota (quota_cores < 1 and period_ms > 0) it runs as `throttled_ms` does, else it takes work_ms."""

    work_ms: float
    quota_cores: float = 1.0
    period_ms: float = 0.0
    first_ms: float = 0.0

    @property
    def quota(self) -> bool:
        return 0 < self.quota_cores < 1 and self.period_ms > 0


RING_TOKENS = 48   # tokens followed round the ring, after RING_WARM
RING_WARM = 16     # tokens to let the phases lock first
OFFSETS = 4        # where each host's period starts against the others': this many spreads


def ring_1(steps: Sequence[Step], hops_ms: Sequence[float],
           driver_ms: float = 0.0) -> tuple[float, tuple[float, ...]]:
    """(ms per token, each step's mean ms) of one stream round the ring: hop, step, hop, ..., step,
    hop, the driver; each quota'd step from the phase of its period it starts at (module docstring),
    averaged over OFFSETS spreads of the hosts' periods and over how much of the overrun a core kept
    (SLACKS, as throttled_ms). Each host's runtime carries from its step to its next (`_Runtime`)."""
    hops = list(hops_ms) + [0.0] * (len(steps) + 1 - len(hops_ms))
    if not any(s.quota for s in steps):
        walls = tuple(s.work_ms for s in steps)
        return sum(walls) + sum(hops) + driver_ms, walls
    runs = []
    for k in range(OFFSETS):
        for j in range(SLACKS):
            runs.append(_follow(steps, hops, driver_ms, k / OFFSETS, j / (SLACKS - 1)))
    token = sum(r[0] for r in runs) / len(runs)
    return token, tuple(sum(r[1][i] for r in runs) / len(runs) for i in range(len(steps)))


def _follow(steps: Sequence[Step], hops: Sequence[float], driver_ms: float, spread: float,
            kept: float) -> tuple[float, list[float]]:
    """ring_1 for one spread of the periods' starts (host i's at (i · 0.618 + spread) of its period)
    and one fraction of the overrun kept: the mean of the last RING_TOKENS tokens. Each quota'd
    host's runtime carries from token to token (`_Runtime`)."""
    hosts = [_Runtime.of(s, ((i * 0.618 + spread) % 1.0) * s.period_ms, kept) if s.quota else None
             for i, s in enumerate(steps)]
    t, total, walls = 0.0, 0.0, [0.0] * len(steps)
    for token in range(RING_WARM + RING_TOKENS):
        start = t
        for i, (step, host) in enumerate(zip(steps, hosts)):
            t += hops[i]
            wall = host.run(t, step.work_ms) if host else step.work_ms
            t += wall
            if token >= RING_WARM:
                walls[i] += wall / RING_TOKENS
        t += hops[len(steps)] + driver_ms
        if token >= RING_WARM:
            total += (t - start) / RING_TOKENS
    return total, walls


@dataclass
class _Runtime:
    """One host's CFS runtime as the ring follows it, carried from one step to the next: a bucket
    that every period's start tops up by the budget, busy or idle, to at most `cap`: the budget and
    the runtime a core keeps for an idle group (spread from none to all, as throttled_ms). A step
    runs while there is runtime and is held to its period's end when there is none. Why carried:
    given the budget and the kept runtime afresh every token, a step needing 4.08 periods of budget
    was held for a fifth period every token (the even split's host at 25%, 10.2 ms of work: 50.0
    ms predicted, 41.7 measured, docs/cluster.md); a step that spent the kept runtime starts the
    next without it and is held a fifth period, and the periods idle between refill it."""

    budget: float
    period: float
    offset: float
    cap: float
    runtime: float
    last: float | None = None

    @classmethod
    def of(cls, step: Step, offset: float, kept: float) -> _Runtime:
        budget = step.quota_cores * step.period_ms
        cap = budget + kept * max(0.0, step.first_ms - budget)
        return cls(budget, step.period_ms, offset, cap, cap)

    def _index(self, t: float) -> int:
        return math.floor((t + 1e-9 - self.offset) / self.period)

    def run(self, t: float, work_ms: float) -> float:
        """Wall ms of a step of `work_ms` started at t; the runtime it leaves stays for the next."""
        if self.last is not None:
            self.runtime = min(self.cap, self.runtime + self.budget * (self._index(t) - self._index(self.last)))
        start, left = t, work_ms
        while left > 1e-12:
            end = self.offset + (self._index(t) + 1) * self.period
            ran = min(left, self.runtime, end - t)
            t, left, self.runtime = t + ran, left - ran, self.runtime - ran
            if left <= 1e-12:
                break
            t = end                  # out of runtime (held) or at the period's end: the next refills
            self.runtime = min(self.cap, self.runtime + self.budget)
        self.last = t
        return t - start
