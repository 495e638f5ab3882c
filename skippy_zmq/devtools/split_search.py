"""Brute force over every split: every ordered choice of hosts and every set of cuts, each scored
by ops/speed.py's model. What tests and `bench cluster` check plan_split's search against; too slow
to plan with (it is exponential in the hosts and the cuts)."""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

from skippy_zmq.ops.speed import HostSpeed, Links, Prediction, Stage, objective_ms, predict


def brute_force(hosts: Sequence[HostSpeed], n_layers: int, need: Callable[[int, int], int], links: Links,
                objective: str, streams: int = 8, n_stages: int | None = None, row_bytes: int = 0
                ) -> Prediction | None:
    """Every ordered choice of hosts (of `n_stages`, default any count) and every set of cuts:
    what tests and `bench cluster` check plan_split against."""
    by_name = {h.name: h for h in hosts}
    best, best_cost = None, math.inf
    for m in [n_stages] if n_stages else range(1, min(len(hosts), n_layers) + 1):
        for order in itertools.permutations(hosts, m):
            for cuts in itertools.combinations(range(1, n_layers), m - 1):
                bounds = (0, *cuts, n_layers)
                stages = tuple(Stage(h.name, a, b) for h, a, b in zip(order, bounds, bounds[1:]))
                if any(h.memory and need(s.start, s.end) > h.memory for h, s in zip(order, stages)):
                    continue
                c = objective_ms(stages, by_name, n_layers, links, objective, streams, row_bytes)
                if c < best_cost - 1e-9:
                    best, best_cost = predict(stages, by_name, n_layers, links, streams, row_bytes), c
    return best
