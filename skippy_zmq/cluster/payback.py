"""Damping re-cuts: a re-cut on drift only when it pays back what the last one cost.

A re-cut is not free: the engine pauses, the moved stages restart and compile, every running
session is prefilled again (measured on 2 shared cores: 12-45 s paused, then 16-53 s of
compiling behind serving). A second drift re-cut right after the first (the fresh numbers are
noisy just after a switch) paid all of it again for a split predicted ~20% faster, and its
after-window was worse than not re-cutting at all. So a drift re-cut goes ahead only when

    saved_s = payback_s x (1 - planned ms per token / current ms per token)  >  cost_s

where both ms per token come from ops/speed.predict at the same (drift-scaled) measured speeds, for
the configured objective, and cost_s is the last re-cut's measured cost (its begin until every
stage of its split was ready and done compiling). Until one re-cut has been measured, there is no
cost to weigh: the first goes ahead. `skippy-zmq rebalance`, a worker gone or joined are never
damped (the first is asked for; the others change what can serve).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.config.topology import Topology
from skippy_zmq.ops.speed import Links, SpeedPlanError, Stage, objective_ms


@dataclasses.dataclass(frozen=True)
class Payback:
    current_ms: float          # the split serving now, at the speeds the new plan was made with
    planned_ms: float          # the new split, the same way
    cost_s: float | None       # the last re-cut's measured cost (None: none measured yet)
    payback_s: float           # cluster.recut_payback_s

    @property
    def saved_s(self) -> float:
        if self.current_ms <= 0:
            return 0.0
        return self.payback_s * max(0.0, 1.0 - self.planned_ms / self.current_ms)

    @property
    def worth_it(self) -> bool:
        return self.cost_s is None or self.saved_s > self.cost_s

    def text(self) -> str:
        cost = "none measured yet" if self.cost_s is None else f"{self.cost_s:.1f} s"
        return (f"predicted {self.current_ms:.2f} -> {self.planned_ms:.2f} ms per token saves "
                f"{self.saved_s:.1f} s over {self.payback_s:g} s of serving; the last re-cut cost {cost}")


def current_ms(topology: Topology, stage_workers: Sequence[str | None], measured: Mapping[str, Mapping[str, Any]],
               objective: str, streams: int) -> float | None:
    """The objective's predicted ms per token of the split serving now (`topology`'s ranges, stage i on
    stage_workers[i]) at the `measured` speeds (name -> measure_host dict, drift-scaled), with the hop
    costs the rebalancer plans with (none); None when a stage has no measured worker."""
    from skippy_zmq.cluster.split import host_speed, row_bytes

    if any(w is None or w not in measured for w in stage_workers):
        return None
    cfg = ModelConfig.load(topology.model_path / "model.json")
    hosts = {w: host_speed(w, measured[w]) for w in stage_workers}
    stages = [Stage(w, s.start, s.end) for s, w in zip(topology.stages, stage_workers)]
    try:
        return objective_ms(stages, hosts, cfg.n_layers, Links(), objective, streams,
                            row_bytes(topology, cfg.d_model))
    except SpeedPlanError:
        return None


def planned_ms(prediction: Any, objective: str) -> float:
    """ops/speed.Prediction -> the objective's ms per token (objective_ms's rule)."""
    if objective == "latency":
        return prediction.ms_per_token_1
    return prediction.round_ms_n / prediction.streams
