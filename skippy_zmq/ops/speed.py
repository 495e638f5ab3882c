"""A layer split by measured speed under memory caps: which hosts, in which order, own which
layers. Pure arithmetic over numbers measured elsewhere (cluster/measure.py); no JAX.

The time model, per host h (its measurement, `HostSpeed`) and rows r a step carries:

    stage(h, [a, b), r) = step_h(r) + soft_h(r) + (b - a) · layer_h(r) + head_h(r) if b == n_layers
    hop(x, y, n)        = rtt(x, y) / 2 + n / bandwidth(x, y)   (ms; the driver is host DRIVER)

soft_h(r): the stage's own software per step besides its compute (receive, decode, place the rows,
trace, encode, send), measured on the host inside its CPU quota like the rest, so a host at a
quarter of a core pays four times as much for it (cluster/software.py).

n is what the hop carries: between stages a step's activation (rows · `row_bytes`, [rows,
d_model] in the wire dtype), to and from the driver a few bytes (token ids), so the order of
the hosts matters where links differ. A token of one stream goes driver -> s0 -> ... -> s_last
-> driver, each stage in turn:

    latency(1)  = Σ burst(h_i, stage(h_i, range_i, 1)) + Σ hop over the ring + driver   (one stream)

driver (`Links.driver_ms`): what the driver's own loop spends on a token (its receive, scheduler,
hand-off to the request and send), measured on the driver's machine; the same for every split.
Every hop also pays `Links.hop_fixed_ms` beside its link: the sender's encoding, the receiver's
wake-up and decoding, measured with the driver's time on a one-stage ring of real processes.

burst(): a host under a CPU quota (a cgroup's q cores every period P) was measured by a loop
that kept it busy, so its times are the throttled, sustained ones. One stream leaves each host
idle while the others compute (a token takes longer than P), so a step starts with the period's
whole budget: e = idle ÷ busy time (`HostSpeed.idle_ratio`: q, a step being one thread's work,
cluster/measure.quota_burst: a process under a quota below a core runs one thread, its JAX pool
and the kernel's helpers sized by the quota, config/cpus.py). A step of sustained time t then takes e·t when it ends within
`burst_ms` (the budget and the runtime the kernel leaves on a core of an idle group, averaged
from none to all of it), and about
t when it is many periods long (`throttled_ms`: e·t of work at a quota of e, averaged over
where in the period it starts, the first period's overrun paid by the next ones).
That average is what the search minimises; the figure `predict` reports follows the ring token by
token instead (ops/cfs.ring_1): a step held at the end of its budget locks the phase it starts at.

N streams run as M = n_stages micro-batches of ceil(N / M) rows (engine/scheduler.py), each a
step of r rows (that count padded to its row bucket, as the runner pads it) and a round of the
ring; a stage serves the M micro-batches one after another. A host busy all round long runs at
its sustained speed; one that idles part of each round bursts like a 1-stream step (the quiet
bench cluster run's non-bottleneck hosts ran their steps at e·t, idle 72-94% of the round), so
with burst(h, x) the step started idle and stage(h, x) the sustained one:

    round(N)    = max(Σ burst(h_i, range_i, r) + Σ hop,  M · max_i stage(h_i, range_i, r))
    tok/s(N)    = N / round(N)

(the second term: the bottleneck's CPU a round at its quota; a host without a quota bursts to
its sustained time, so for it this is the plain pipeline bound).

`plan_split` finds, exactly, the split minimising latency(1) (objective "latency") or round(N)
(objective "throughput") over every ordered choice of hosts and every set of cut points, each
stage within its host's memory budget (`need(a, b)` bytes, ops/placement.py's byte-exact
prediction). Dynamic programming over (hosts used, last host, layers covered): the cost of a
chain is a sum (latency) or, for a fixed bottleneck bound B, a sum of burst times whose every
stage's sustained time must stay <= B; round(N) = max(sum, M·B) is minimised by a search over
the finite set of sustained stage times. Where the other objective's best split predicts within
`TIE` (2%) of that optimum, the model cannot order the two and plan_split keeps the one better on
the other objective (tie=0: the exact optimum, what devtools/split_search.brute_force checks). With
the stage count left open, a split of more stages is kept only where predicted better than the
best with fewer by over `FEWER` (15%), and a one-stage split runs at its host's `alone` figures
(`solo`: no other host shares the machine).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from skippy_zmq.config.model import Buckets
from skippy_zmq.ops.cfs import Step, ring_1, throttled_ms

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
    idle_ratio: float = 1.0                  # a short step started idle ÷ busy, under a CPU quota
    period_ms: float = 0.0                   # the quota's period (0: no quota)
    software_ms: tuple[float, ...] = ()      # the stage's own software per step besides compute (per row count)
    burst_ms: float = 0.0                    # work a step started idle runs before its first stall (0: idle_ratio · period)
    # the same host's figures with no other host busy (`decode_alone`, where a bench blended them with
    # all-busy ones): what a one-stage split runs at, no neighbour sharing the machine (`solo`)
    alone: HostSpeed | None = field(default=None, compare=False, repr=False)

    def at(self, values: tuple[float, ...], rows: int) -> float:
        if rows <= self.rows[0]:
            return values[0]
        for (r0, r1), (v0, v1) in zip(zip(self.rows, self.rows[1:]), zip(values, values[1:])):
            if rows <= r1:
                return v0 + (rows - r0) / (r1 - r0) * (v1 - v0)
        return values[-1]

    @property
    def bursts(self) -> bool:
        """Under a CPU quota whose idle start runs faster than its busy loop (module docstring)."""
        return 0 < self.idle_ratio < 1 and self.period_ms > 0

    def stage_ms(self, layers: int, last: bool, rows: int = 1, burst: bool = False) -> float:
        """A step's time; burst: starting idle, with its CPU quota's whole budget (module docstring)."""
        head = self.at(self.head_ms, rows) if last else 0.0
        soft = self.at(self.software_ms, rows) if self.software_ms else 0.0
        sustained = self.at(self.step_ms, rows) + soft + layers * self.at(self.layer_ms, rows) + head
        if not burst or not self.bursts:
            return sustained
        return throttled_ms(sustained * self.idle_ratio, self.idle_ratio, self.period_ms, self.burst_ms)

    def step(self, layers: int, last: bool) -> Step:
        """A 1-row step of this host's stage as cfs.ring_1 follows it: its work at full speed and the quota."""
        sustained = self.stage_ms(layers, last)
        if not self.bursts:
            return Step(sustained)
        return Step(sustained * self.idle_ratio, self.idle_ratio, self.period_ms, self.burst_ms)

    @classmethod
    def from_measure(cls, m: Mapping[str, Any], memory: int = 0, name: str | None = None) -> HostSpeed:
        """From cluster/measure.measure_host's dict: a message's send, receive and decode count in
        every step, the final stage's sampling in its head. Where its many-row `decode` figures blend
        in ones taken with every host busy (bench cluster's many_rows), its `decode_alone` ones
        make `alone`."""
        alone = None
        if isinstance(m.get("decode_alone"), Mapping):
            lone = {k: v for k, v in m.items() if k not in ("decode_alone", "decode_together")}
            alone = cls.from_measure({**lone, "decode": m["decode_alone"]}, memory, name)
        return dataclasses.replace(cls._from_measure(m, memory, name), alone=alone)

    @classmethod
    def _from_measure(cls, m: Mapping[str, Any], memory: int, name: str | None) -> HostSpeed:
        try:
            idle = float(m.get("idle_ratio") or 1.0)
            decode = {r: _cpu_row(entry, idle) if r == "1" else entry for r, entry in m["decode"].items()}
            rows = sorted(decode, key=int)
            pick = lambda key: tuple(float(decode[r].get(key, 0.0)) for r in rows)   # noqa: E731
            step = tuple(s + w for s, w in zip(pick("step_ms"), pick("message_ms")))
            head = tuple(h + s for h, s in zip(pick("head_ms"), pick("sample_ms")))
            return cls(name or str(m.get("name", "host")), tuple(int(r) for r in rows), pick("layer_ms"),
                       step, head, float(m.get("prefill", {}).get("layer_ms_per_token", 0.0)),
                       int(memory or m.get("memory", 0)), float(m.get("idle_ratio") or 1.0),
                       float(m.get("cpu_period_ms") or 0.0), pick("software_ms"), float(m.get("burst_ms") or 0.0))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise SpeedPlanError(f"host measurement {m.get('name', '?')!r} is not a measure_host result: "
                                 f"{exc!r}") from None


def _cpu_row(entry: Mapping[str, Any], idle_ratio: float) -> Mapping[str, Any]:
    """A 1-row figure of a host under a quota below a core, from its CPU time where measured
    (cluster/measure.py `cpu`): a step started idle is that much work at full speed, its sustained
    time that over the quota. A throttled loop's clock also holds the turns its neighbours take:
    measured twice a few minutes apart on the 2-core Xeon at load 9, a 50% host's layer read 1.05 and
    0.63 ms by the clock, 0.326 and 0.307 of CPU; a 25% host's fixed cost 2.93 and 1.48 by the clock."""
    cpu = entry.get("cpu")
    if not isinstance(cpu, Mapping) or not 0 < idle_ratio < 1:
        return entry
    return {**entry, **{k: float(cpu[k]) / idle_ratio for k in ("layer_ms", "step_ms", "head_ms") if k in cpu}}


@dataclass(frozen=True)
class Links:
    """Hop costs: one-way latency in ms (`pairs[(x, y)]` where measured, else `default_ms`) and
    bandwidth in bytes per ms (`bandwidth[(x, y)]`, else `default_bytes_per_ms`; 0: unlimited);
    every hop's software beside its link (`hop_fixed_ms`: encoding, the receiver's wake-up and
    decoding, measured on a ring of real processes), and the driver's own time a token
    (`driver_ms`), charged once a round of the ring."""

    default_ms: float = 0.0
    pairs: Mapping[tuple[str, str], float] = field(default_factory=dict)
    default_bytes_per_ms: float = 0.0
    bandwidth: Mapping[tuple[str, str], float] = field(default_factory=dict)
    driver_ms: float = 0.0
    hop_fixed_ms: float = 0.0

    def ms(self, a: str, b: str, nbytes: int = 0) -> float:
        rate = self.bandwidth.get((a, b), self.default_bytes_per_ms)
        return self.pairs.get((a, b), self.default_ms) + self.hop_fixed_ms + \
            (nbytes / rate if nbytes and rate > 0 else 0.0)

    @classmethod
    def from_rtt(cls, default_rtt_ms: float = 0.0, rtt: Mapping[tuple[str, str], float] | None = None,
                 default_bytes_per_s: float = 0.0, bytes_per_s: Mapping[tuple[str, str], float] | None = None) -> Links:
        """From round trips (a hop is half of one) and bandwidths in bytes/s; each symmetric unless
        both directions are given."""
        return cls(default_rtt_ms / 2, _symmetric(rtt, 0.5), default_bytes_per_s / 1000,
                   _symmetric(bytes_per_s, 1e-3))

    @classmethod
    def from_driver_links(cls, found: Mapping[str, Mapping[str, Any]], default_rtt_ms: float = 0.0,
                          rtt: Mapping[tuple[str, str], float] | None = None,
                          pairs: Mapping[tuple[str, str], Mapping[str, float]] | None = None) -> Links:
        """From each host's measured link to the driver (name -> {rtt_ms, bytes_per_s}, as a
        worker reports it: cluster/probe.py): the driver's hops as measured; a hop between two
        hosts as measured between them (`pairs[(x, y)]`: {rtt_ms, bytes_per_s} of the hop x -> y,
        the reverse hop alike unless measured too: cluster/peers.py), else the larger round trip
        and the smaller bandwidth of their two driver links; `rtt` (round trips given by hand)
        wins; a host with no usable link costs `default_rtt_ms`."""
        ok = {name: (float(d["rtt_ms"]), float(d["bytes_per_s"])) for name, d in found.items()
              if all(isinstance(d.get(k), (int, float)) and d[k] > 0 for k in ("rtt_ms", "bytes_per_s"))}
        rtts, rates = {}, {}
        for a, (rtt_a, rate_a) in ok.items():
            rtts[(DRIVER, a)], rates[(DRIVER, a)] = rtt_a, rate_a
            for b, (rtt_b, rate_b) in ok.items():
                if a != b:
                    rtts[(a, b)], rates[(a, b)] = max(rtt_a, rtt_b), min(rate_a, rate_b)
        measured = dict(pairs or {})
        for (a, b), d in list(measured.items()):
            measured.setdefault((b, a), d)
        for key, d in measured.items():
            rtts[key], rates[key] = float(d["rtt_ms"]), float(d["bytes_per_s"])
        return cls.from_rtt(default_rtt_ms, {**rtts, **(rtt or {})}, 0.0, rates)


def _symmetric(values: Mapping[tuple[str, str], float] | None, scale: float) -> dict[tuple[str, str], float]:
    pairs: dict[tuple[str, str], float] = {}
    for (a, b), value in (values or {}).items():
        pairs.setdefault((b, a), value * scale)
        pairs[(a, b)] = value * scale
    return pairs


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
    hop_ms_1: tuple[float, ...] = ()  # each hop of the ring at 1 row: driver -> s0, ..., s_last -> driver

    def to_json(self) -> dict[str, Any]:
        return {"stages": [{"host": s.host, "start": s.start, "end": s.end} for s in self.stages],
                "ms_per_token_1": round(self.ms_per_token_1, 3), "tok_s_1": round(self.tok_s_1, 2),
                "streams": self.streams, "round_ms_n": round(self.round_ms_n, 3), "tok_s_n": round(self.tok_s_n, 2),
                "stage_ms_1": [round(v, 3) for v in self.stage_ms_1],
                "stage_ms_n": [round(v, 3) for v in self.stage_ms_n],
                "prefill_ms_per_token": round(self.prefill_ms_per_token, 4),
                "hop_ms_1": [round(v, 4) for v in self.hop_ms_1]}


def micro_rows(streams: int, n_stages: int) -> int:
    """Rows a micro-batch's step computes when `streams` decode over n_stages micro-batches: its
    streams, padded to the row bucket the runner pads a step to (config.Buckets.decode_rows)."""
    return Buckets().rows_for(min(max(1, math.ceil(streams / n_stages)), Buckets().decode_rows[-1]))


TOKEN_BYTES = 8   # what a hop to or from the driver carries per row (token ids, positions): next to nothing


def hops_ms(stages: Sequence[Stage], links: Links, rows: int = 1, row_bytes: int = 0) -> list[float]:
    """Each hop of one step round the ring: activations between stages, token ids to and from the driver."""
    hosts = [DRIVER] + [s.host for s in stages] + [DRIVER]
    sizes = [rows * TOKEN_BYTES] + [rows * row_bytes] * (len(stages) - 1) + [rows * TOKEN_BYTES]
    return [links.ms(a, b, n) for (a, b), n in zip(zip(hosts, hosts[1:]), sizes)]


def ring_ms(stages: Sequence[Stage], links: Links, rows: int = 1, row_bytes: int = 0) -> float:
    """A round of the ring besides the stages: its hops and the driver's own time."""
    return sum(hops_ms(stages, links, rows, row_bytes)) + links.driver_ms


def solo(hosts: Mapping[str, HostSpeed]) -> dict[str, HostSpeed]:
    """Each host as a one-stage split runs it: with no other host busy (`HostSpeed.alone` where known).
    On one machine shared by the hosts (bench cluster), h100 alone served 8 streams at 169.7 tok/s
    where its blended figures predicted 140.8 (alone 154.1); on machines of their own the two agree."""
    return {name: h.alone or h for name, h in hosts.items()}


def predict(stages: Sequence[Stage], hosts: Mapping[str, HostSpeed], n_layers: int, links: Links,
            streams: int = 8, row_bytes: int = 0) -> Prediction:
    """Time per token (1 stream) and tok/s (1 and `streams` streams) of a split (module docstring).
    row_bytes: one row's activation on the wire (d_model x the wire dtype's bytes)."""
    m = len(stages)
    hosts = solo(hosts) if m == 1 else hosts
    rows = micro_rows(streams, m)
    hops = tuple(hops_ms(stages, links, 1, row_bytes))
    latency, one = ring_1([hosts[s.host].step(s.end - s.start, s.end == n_layers) for s in stages], hops,
                          links.driver_ms)
    steady = tuple(hosts[s.host].stage_ms(s.end - s.start, s.end == n_layers, rows) for s in stages)
    quick = tuple(hosts[s.host].stage_ms(s.end - s.start, s.end == n_layers, rows, burst=True) for s in stages)
    round_ms = max(sum(quick) + ring_ms(stages, links, rows, row_bytes), m * max(steady))
    # the host that bounds the round is busy all along (its sustained time), the others burst
    many = tuple(t if m * t >= round_ms - 1e-9 else q for t, q in zip(steady, quick))
    prefill = max(hosts[s.host].prefill_ms_per_token * (s.end - s.start) for s in stages)
    return Prediction(tuple(stages), latency, 1000 / latency, streams, round_ms, 1000 * streams / round_ms,
                      one, many, prefill, hops)


def objective_ms(stages: Sequence[Stage], hosts: Mapping[str, HostSpeed], n_layers: int, links: Links,
                 objective: str, streams: int, row_bytes: int = 0) -> float:
    """What plan_split minimises: latency(1) as the module docstring's sum, each step's burst
    averaged over its phase (the ring's locked phase, which predict's figure follows, is not a sum
    a search can split), or round(N) / N."""
    if objective == "latency":
        hosts = solo(hosts) if len(stages) == 1 else hosts
        return sum(hosts[s.host].stage_ms(s.end - s.start, s.end == n_layers, 1, burst=True)
                   for s in stages) + ring_ms(stages, links, 1, row_bytes)
    return predict(stages, hosts, n_layers, links, streams, row_bytes).round_ms_n / streams


# Predictions this close (relative) are a tie: the model cannot order them. Its error between two
# splits of one run was up to ~15% (docs/cluster.md "Figures": the latency and throughput plans
# predicted 16.80 / 16.81 ms measured 18.23 / 15.66); 2% keeps what a tie-break can cost the
# objective small, and the recorded runs bear it out: the quiet run's 1-stream pick (4.5% ahead of
# the throughput plan by prediction, 10% ahead measured) stays, the final run's goes to the split
# that measured best (tests/test_speed_quota.py).
TIE = 0.02
# A split of more stages than another is taken only where predicted better than the best with fewer
# by more than this (relative), when the stage count is the planner's to choose: the model
# over-predicts a round of stages that share their micro-batches evenly (8 streams, two stages
# whose steps are within 0.7x of each other: 1.08-1.18 predicted ÷ measured, against 0.93-1.02 for
# uneven ones and 0.91 for a stage alone; tests/test_speed_records.py, the unheld run), and every
# more stage is another process, hop and failure. That run's unheld throughput plan, h50:13 / h100:17
# predicted 161.0 tok/s against h100 alone's 154.1, measured 137.0 against 169.7.
FEWER = 0.15


def plan_split(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int], links: Links = Links(),
               objective: str = "latency", streams: int = 8, n_stages: int | None = None,
               row_bytes: int = 0, tie: float = TIE, fewer: float = FEWER) -> Prediction:
    """The best split (module docstring). `n_stages`: use exactly that many hosts (default: any
    number, 1 to len(hosts)); row_bytes: one activation row on the wire (hops cost its transfer).
    A tie (the other objective's best split of as many stages within `tie` of this one on this
    objective) goes to the split better on the other objective: a 1-stream tie to the split that
    serves many streams faster, and the other way round; tie=0: the exact optimum. With the stage
    count left open, fewer stages win unless more are predicted better by over `fewer` (FEWER).
    Raises SpeedPlanError when no split fits the memory budgets."""
    best = _plan_exact(hosts, n_layers, need, links, objective, streams, n_stages, row_bytes)
    if tie <= 0:
        return best
    by_name = {h.name: h for h in hosts}
    cost = lambda p, obj: objective_ms(p.stages, by_name, n_layers, links, obj, streams, row_bytes)   # noqa: E731
    if n_stages is None and fewer > 0:
        best = _fewest(hosts, n_layers, need, links, objective, streams, row_bytes, best,
                       lambda p: cost(p, objective) <= (1 + fewer) * cost(best, objective))
    other = OBJECTIVES[1 - OBJECTIVES.index(objective)]
    # the other objective's best with as many stages (one search, not one per stage count)
    alt = _plan_exact(hosts, n_layers, need, links, other, streams, len(best.stages), row_bytes)
    if cost(alt, objective) <= (1 + tie) * cost(best, objective) and cost(alt, other) < cost(best, other) - 1e-9:
        return alt
    return best


def _fewest(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int], links: Links,
            objective: str, streams: int, row_bytes: int, best: Prediction,
            near: Callable[[Prediction], bool]) -> Prediction:
    """The best split of the fewest stages that is `near` the optimum `best` (best itself if none is)."""
    for m in range(1, len(best.stages)):
        try:
            fewer = _plan_exact(hosts, n_layers, need, links, objective, streams, m, row_bytes)
        except SpeedPlanError:    # no split of m of these hosts fits their memory
            continue
        if near(fewer):
            return fewer
    return best


def _plan_exact(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int], links: Links,
                objective: str, streams: int, n_stages: int | None, row_bytes: int) -> Prediction:
    """plan_split's exact optimum for one objective."""
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
        for stages in _best_chains(hosts, n_layers, need, links, objective, streams, m, row_bytes):
            cost = objective_ms(stages, by_name, n_layers, links, objective, streams, row_bytes)
            if best is None or cost < objective_ms(best.stages, by_name, n_layers, links, objective, streams,
                                                   row_bytes) - 1e-9:
                best = predict(stages, by_name, n_layers, links, streams, row_bytes)
    if best is None:
        raise SpeedPlanError(_no_fit(hosts, n_layers, need))
    return best


def _best_chains(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int], links: Links,
                 objective: str, streams: int, m: int, row_bytes: int = 0) -> list[tuple[Stage, ...]]:
    """The chain(s) of m stages that can be best for the objective (one for latency; for
    throughput, the least-sum chain under each candidate bottleneck bound on the search path)."""
    latency = objective == "latency"
    rows = 1 if latency else micro_rows(streams, m)
    hosts = [h.alone or h for h in hosts] if m == 1 else hosts   # predict's `solo`
    fits = functools.lru_cache(maxsize=None)(lambda h, a, b: not hosts[h].memory or need(a, b) <= hosts[h].memory)
    # a stage's time in the ring's sum: started idle (a quota'd host bursts); its bound: sustained
    cost = functools.lru_cache(maxsize=None)(lambda h, a, b: hosts[h].stage_ms(b - a, b == n_layers, rows, True))
    limit = functools.lru_cache(maxsize=None)(lambda h, a, b: hosts[h].stage_ms(b - a, b == n_layers, rows))
    hop = functools.lru_cache(maxsize=None)(   # what a hop carries: ring_ms's sizes
        lambda a, b: links.ms(a, b, rows * (TOKEN_BYTES if DRIVER in (a, b) else row_bytes)))
    if latency:
        chain = _min_sum_chain(hosts, n_layers, fits, cost, hop, m, math.inf, limit)
        return [chain] if chain else []
    bounds = sorted({limit(h, a, b) for h in range(len(hosts)) for a in range(n_layers)
                     for b in range(a + 1, n_layers + 1)})
    # round = max(sum(B), m·B): sum(B) (the least sum with every stage <= B) falls as B rises and
    # m·B rises, so the best B is where they cross: the first B with sum(B) <= m·B, or the one before.
    lo, hi, found = 0, len(bounds) - 1, []
    while lo <= hi:
        mid = (lo + hi) // 2
        chain = _min_sum_chain(hosts, n_layers, fits, cost, hop, m, bounds[mid], limit)
        if chain:
            found.append(chain)
        total = math.inf if chain is None else sum(cost(_index(hosts, s.host), s.start, s.end) for s in chain) + \
            ring_ms(chain, links, rows, row_bytes)
        if total <= m * bounds[mid]:
            hi = mid - 1
        else:
            lo = mid + 1
    for k in (lo - 1, lo):    # the crossing's neighbours, in case the search stepped over one
        if 0 <= k < len(bounds):
            chain = _min_sum_chain(hosts, n_layers, fits, cost, hop, m, bounds[k], limit)
            if chain:
                found.append(chain)
    return found


def _index(hosts: Sequence[HostSpeed], name: str) -> int:
    return next(i for i, h in enumerate(hosts) if h.name == name)


def _min_sum_chain(hosts: Sequence[HostSpeed], n_layers: int, fits: Callable[[int, int, int], bool],
                   cost: Callable[[int, int, int], float], hop: Callable[[str, str], float], m: int,
                   bound: float, limit: Callable[[int, int, int], float]) -> tuple[Stage, ...] | None:
    """Least Σ stage cost + hops over chains of m distinct hosts covering [0, n_layers), every
    stage fitting its host's memory and its `limit` (sustained time) <= bound. DP state: (hosts
    used, last host, end)."""
    names = [h.name for h in hosts]
    # best[(mask, last, end)] = (cost so far, previous state)
    layer: dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None]] = {}
    for h in range(len(hosts)):
        for b in range(1, n_layers - (m - 1) + 1):
            c = cost(h, 0, b)
            if limit(h, 0, b) <= bound and fits(h, 0, b):
                layer[(1 << h, h, b)] = (hop(DRIVER, names[h]) + c, None)
    states = [layer]
    for k in range(1, m):
        nxt: dict[tuple[int, int, int], tuple[float, tuple[int, int, int] | None]] = {}
        for (mask, last, a), (so_far, _) in states[-1].items():
            for h in range(len(hosts)):
                if mask >> h & 1:
                    continue
                link = hop(names[last], names[h])
                for b in range(a + 1, n_layers - (m - 1 - k) + 1):
                    c = cost(h, a, b)
                    if limit(h, a, b) > bound or not fits(h, a, b):
                        continue
                    key, total = (mask | 1 << h, h, b), so_far + link + c
                    if key not in nxt or total < nxt[key][0]:
                        nxt[key] = (total, (mask, last, a))
        states.append(nxt)
    ends = [(v[0] + hop(names[key[1]], DRIVER), key) for key, v in states[-1].items() if key[2] == n_layers]
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
