"""A layer split by measured speed under memory caps: which hosts, in which order, own which
layers. Pure arithmetic over numbers measured elsewhere (cluster/measure.py); no JAX.

The time model, per host h (its measurement, `HostSpeed`) and rows r a step carries:

    stage(h, [a, b), r) = step_h(r) + (b - a) · layer_h(r) + head_h(r) if b == n_layers
    hop(x, y)           = one-way link cost x -> y (ms), the driver being host DRIVER

A token of one stream goes driver -> s0 -> ... -> s_last -> driver, each stage in turn:

    latency(1)  = Σ stage(h_i, range_i, 1) + Σ hop over the ring                 (one stream)

N streams run as M = n_stages micro-batches of ceil(N / M) rows (engine/scheduler.py), each a
step of r rows (that count padded to its row bucket, as the runner pads it) and a round of the
ring; a stage serves the M micro-batches one after another, so a round takes

    round(N)    = max(Σ stage(h_i, range_i, r) + Σ hop,  M · max_i stage(h_i, range_i, r))
    tok/s(N)    = N / round(N)

`plan_split` finds, exactly, the split minimising latency(1) (objective "latency") or round(N)
(objective "throughput") over every ordered choice of hosts and every set of cut points, each
stage within its host's memory budget (`need(a, b)` bytes, ops/placement.py's byte-exact
prediction). Dynamic programming over (hosts used, last host, layers covered): the cost of a
chain is a sum (latency) or, for a fixed bottleneck bound B, a sum whose every stage must stay
<= B; round(N) = max(sum, M·B) is minimised by a search over the finite set of stage times.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from skippy_zmq.config.model import Buckets

DRIVER = "driver"
MAX_HOSTS = 8          # 2^H · H states per layer count: beyond this a plan takes too long in Python
OBJECTIVES = ("latency", "throughput")


class SpeedPlanError(ValueError):
    """No split fits, or the measurements are unusable; the message says which."""


@dataclass(frozen=True)
class HostSpeed:
    """One host's measured per-step times (ms) at the row counts measured (piecewise linear between
    them, flat beyond), its memory budget (bytes; 0 = unlimited) and a name."""

    name: str
    rows: tuple[int, ...]                    # the row counts measured, ascending, e.g. (1, 4, 8)
    layer_ms: tuple[float, ...]              # one decoder layer, per step
    step_ms: tuple[float, ...]               # what a step pays once (dispatch, in/out copies, a message)
    head_ms: tuple[float, ...]               # the final norm, head and sampling (last stage only)
    prefill_ms_per_token: float = 0.0        # one layer, per prompt token
    memory: int = 0

    def at(self, values: tuple[float, ...], rows: int) -> float:
        if rows <= self.rows[0]:
            return values[0]
        for (r0, r1), (v0, v1) in zip(zip(self.rows, self.rows[1:]), zip(values, values[1:])):
            if rows <= r1:
                return v0 + (rows - r0) / (r1 - r0) * (v1 - v0)
        return values[-1]

    def stage_ms(self, layers: int, last: bool, rows: int = 1) -> float:
        head = self.at(self.head_ms, rows) if last else 0.0
        return self.at(self.step_ms, rows) + layers * self.at(self.layer_ms, rows) + head

    @classmethod
    def from_measure(cls, m: Mapping[str, Any], memory: int = 0, name: str | None = None) -> HostSpeed:
        """From cluster/measure.measure_host's dict: a message's send, receive and decode count in
        every step, the final stage's sampling in its head."""
        try:
            decode = m["decode"]
            rows = sorted(decode, key=int)
            pick = lambda key: tuple(float(decode[r].get(key, 0.0)) for r in rows)   # noqa: E731
            step = tuple(s + w for s, w in zip(pick("step_ms"), pick("message_ms")))
            head = tuple(h + s for h, s in zip(pick("head_ms"), pick("sample_ms")))
            return cls(name or str(m.get("name", "host")), tuple(int(r) for r in rows), pick("layer_ms"),
                       step, head, float(m.get("prefill", {}).get("layer_ms_per_token", 0.0)),
                       int(memory or m.get("memory", 0)))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise SpeedPlanError(f"host measurement {m.get('name', '?')!r} is not a measure_host result: "
                                 f"{exc!r}") from None


@dataclass(frozen=True)
class Links:
    """One-way hop costs in ms: `pairs[(x, y)]` where measured, else `default_ms`."""

    default_ms: float = 0.0
    pairs: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def ms(self, a: str, b: str) -> float:
        return self.pairs.get((a, b), self.default_ms)

    @classmethod
    def from_rtt(cls, default_rtt_ms: float = 0.0, rtt: Mapping[tuple[str, str], float] | None = None) -> Links:
        """From round trips (a hop is half of one; symmetric unless both directions are given)."""
        pairs: dict[tuple[str, str], float] = {}
        for (a, b), value in (rtt or {}).items():
            pairs.setdefault((b, a), value / 2)
            pairs[(a, b)] = value / 2
        return cls(default_rtt_ms / 2, pairs)


@dataclass(frozen=True)
class Stage:
    host: str
    start: int
    end: int


@dataclass(frozen=True)
class Prediction:
    stages: tuple[Stage, ...]
    ms_per_token_1: float            # one stream
    tok_s_1: float
    streams: int
    round_ms_n: float                # one round of `streams` streams
    tok_s_n: float
    stage_ms_1: tuple[float, ...]
    stage_ms_n: tuple[float, ...]
    prefill_ms_per_token: float      # the slowest stage's prompt time per token (chunks pipeline)

    def to_json(self) -> dict[str, Any]:
        return {"stages": [{"host": s.host, "start": s.start, "end": s.end} for s in self.stages],
                "ms_per_token_1": round(self.ms_per_token_1, 3), "tok_s_1": round(self.tok_s_1, 2),
                "streams": self.streams, "round_ms_n": round(self.round_ms_n, 3), "tok_s_n": round(self.tok_s_n, 2),
                "stage_ms_1": [round(v, 3) for v in self.stage_ms_1],
                "stage_ms_n": [round(v, 3) for v in self.stage_ms_n],
                "prefill_ms_per_token": round(self.prefill_ms_per_token, 4)}


def micro_rows(streams: int, n_stages: int) -> int:
    """Rows a micro-batch's step computes when `streams` decode over n_stages micro-batches: its
    streams, padded to the row bucket the runner pads a step to (config.Buckets.decode_rows)."""
    return Buckets().rows_for(min(max(1, math.ceil(streams / n_stages)), Buckets().decode_rows[-1]))


def ring_ms(stages: Sequence[Stage], links: Links) -> float:
    hosts = [DRIVER] + [s.host for s in stages] + [DRIVER]
    return sum(links.ms(a, b) for a, b in zip(hosts, hosts[1:]))


def predict(stages: Sequence[Stage], hosts: Mapping[str, HostSpeed], n_layers: int, links: Links,
            streams: int = 8) -> Prediction:
    """Time per token (1 stream) and tok/s (1 and `streams` streams) of a split (module docstring)."""
    ring, m = ring_ms(stages, links), len(stages)
    rows = micro_rows(streams, m)
    one = tuple(hosts[s.host].stage_ms(s.end - s.start, s.end == n_layers, 1) for s in stages)
    many = tuple(hosts[s.host].stage_ms(s.end - s.start, s.end == n_layers, rows) for s in stages)
    latency = sum(one) + ring
    round_ms = max(sum(many) + ring, m * max(many))
    prefill = max(hosts[s.host].prefill_ms_per_token * (s.end - s.start) for s in stages)
    return Prediction(tuple(stages), latency, 1000 / latency, streams, round_ms, 1000 * streams / round_ms,
                      one, many, prefill)


def objective_ms(stages: Sequence[Stage], hosts: Mapping[str, HostSpeed], n_layers: int, links: Links,
                 objective: str, streams: int) -> float:
    p = predict(stages, hosts, n_layers, links, streams)
    return p.ms_per_token_1 if objective == "latency" else p.round_ms_n / streams


def plan_split(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int], links: Links = Links(),
               objective: str = "latency", streams: int = 8, n_stages: int | None = None) -> Prediction:
    """The best split (module docstring). `n_stages`: use exactly that many hosts (default: any
    number, 1 to len(hosts)). Raises SpeedPlanError when no split fits the memory budgets."""
    if objective not in OBJECTIVES:
        raise SpeedPlanError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not 1 <= len(hosts) <= MAX_HOSTS:
        raise SpeedPlanError(f"plan for 1 to {MAX_HOSTS} hosts, got {len(hosts)}")
    if len({h.name for h in hosts}) != len(hosts):
        raise SpeedPlanError(f"host names repeat: {[h.name for h in hosts]}")
    counts = [n_stages] if n_stages else list(range(1, min(len(hosts), n_layers) + 1))
    by_name = {h.name: h for h in hosts}
    best: Prediction | None = None
    for m in counts:
        for stages in _best_chains(hosts, n_layers, need, links, objective, streams, m):
            cost = objective_ms(stages, by_name, n_layers, links, objective, streams)
            if best is None or cost < objective_ms(best.stages, by_name, n_layers, links, objective, streams) - 1e-9:
                best = predict(stages, by_name, n_layers, links, streams)
    if best is None:
        raise SpeedPlanError(_no_fit(hosts, n_layers, need))
    return best


def _best_chains(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int], links: Links,
                 objective: str, streams: int, m: int) -> list[tuple[Stage, ...]]:
    """The chain(s) of m stages that can be best for the objective (one for latency; for
    throughput, the least-sum chain under each candidate bottleneck bound on the search path)."""
    rows = 1 if objective == "latency" else micro_rows(streams, m)
    fits = functools.lru_cache(maxsize=None)(lambda h, a, b: not hosts[h].memory or need(a, b) <= hosts[h].memory)
    cost = functools.lru_cache(maxsize=None)(lambda h, a, b: hosts[h].stage_ms(b - a, b == n_layers, rows))
    if objective == "latency":
        chain = _min_sum_chain(hosts, n_layers, fits, cost, links, m, math.inf)
        return [chain] if chain else []
    bounds = sorted({cost(h, a, b) for h in range(len(hosts)) for a in range(n_layers)
                     for b in range(a + 1, n_layers + 1)})
    # round = max(sum(B), m·B): sum(B) (the least sum with every stage <= B) falls as B rises and
    # m·B rises, so the best B is where they cross: the first B with sum(B) <= m·B, or the one before.
    lo, hi, found = 0, len(bounds) - 1, []
    while lo <= hi:
        mid = (lo + hi) // 2
        chain = _min_sum_chain(hosts, n_layers, fits, cost, links, m, bounds[mid])
        if chain:
            found.append(chain)
        total = math.inf if chain is None else sum(cost(_index(hosts, s.host), s.start, s.end) for s in chain) + \
            ring_ms(chain, links)
        if total <= m * bounds[mid]:
            hi = mid - 1
        else:
            lo = mid + 1
    for k in (lo - 1, lo):    # the crossing's neighbours, in case the search stepped over one
        if 0 <= k < len(bounds):
            chain = _min_sum_chain(hosts, n_layers, fits, cost, links, m, bounds[k])
            if chain:
                found.append(chain)
    return found


def _index(hosts: Sequence[HostSpeed], name: str) -> int:
    return next(i for i, h in enumerate(hosts) if h.name == name)


def _min_sum_chain(hosts: Sequence[HostSpeed], n_layers: int, fits: Callable[[int, int, int], bool],
                   cost: Callable[[int, int, int], float], links: Links, m: int,
                   bound: float) -> tuple[Stage, ...] | None:
    """Least Σ stage cost + hops over chains of m distinct hosts covering [0, n_layers), every
    stage fitting its host's memory and costing <= bound. DP state: (hosts used, last host, end)."""
    names = [h.name for h in hosts]
    # best[(mask, last, end)] = (cost so far, previous state)
    layer: dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None]] = {}
    for h in range(len(hosts)):
        for b in range(1, n_layers - (m - 1) + 1):
            c = cost(h, 0, b)
            if c <= bound and fits(h, 0, b):
                layer[(1 << h, h, b)] = (links.ms(DRIVER, names[h]) + c, None)
    states = [layer]
    for k in range(1, m):
        nxt: dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None]] = {}
        for (mask, last, a), (so_far, _) in states[-1].items():
            for h in range(len(hosts)):
                if mask >> h & 1:
                    continue
                hop = links.ms(names[last], names[h])
                for b in range(a + 1, n_layers - (m - 1 - k) + 1):
                    c = cost(h, a, b)
                    if c > bound or not fits(h, a, b):
                        continue
                    key, total = (mask | 1 << h, h, b), so_far + hop + c
                    if key not in nxt or total < nxt[key][0]:
                        nxt[key] = (total, (mask, last, a))
        states.append(nxt)
    ends = [(v[0] + links.ms(names[key[1]], DRIVER), key) for key, v in states[-1].items() if key[2] == n_layers]
    if not ends:
        return None
    key = min(ends)[1]
    chain = []
    for k in range(m - 1, -1, -1):
        prev = states[k][key][1]
        chain.append(Stage(names[key[1]], prev[2] if prev else 0, key[2]))
        key = prev
    return tuple(reversed(chain))


def _no_fit(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int]) -> str:
    from skippy_zmq.config.units import format_bytes

    total = need(0, n_layers)
    budgets = ", ".join(f"{h.name} {format_bytes(h.memory) if h.memory else 'unlimited'}" for h in hosts)
    return (f"no split of {n_layers} layers over these hosts fits their memory (budgets: {budgets}; "
            f"the whole model on one stage needs {format_bytes(total)})")


def brute_force(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int], links: Links,
                objective: str, streams: int = 8, n_stages: int | None = None) -> Prediction | None:
    """Every ordered choice of hosts (of `n_stages`, default any count) and every set of cuts:
    what tests and `bench cluster` check plan_split against."""
    import itertools

    by_name = {h.name: h for h in hosts}
    best, best_cost = None, math.inf
    for m in [n_stages] if n_stages else range(1, min(len(hosts), n_layers) + 1):
        for order in itertools.permutations(hosts, m):
            for cuts in itertools.combinations(range(1, n_layers), m - 1):
                bounds = (0, *cuts, n_layers)
                stages = tuple(Stage(h.name, a, b) for h, a, b in zip(order, bounds, bounds[1:]))
                if any(h.memory and need(s.start, s.end) > h.memory for h, s in zip(order, stages)):
                    continue
                c = objective_ms(stages, by_name, n_layers, links, objective, streams)
                if c < best_cost - 1e-9:
                    best, best_cost = predict(stages, by_name, n_layers, links, streams), c
    return best
