"""Damping re-cuts (cluster/payback.py): a drift re-cut goes ahead only when the time its predicted
speed-up saves over `recut_payback_s` of serving beats the last re-cut's measured cost."""

from __future__ import annotations

import pytest

from test_cluster import tiny_model  # noqa: F401 (fixture)
from test_cluster_recut import fake_measure, recut_topology
from skippy_zmq.cluster.payback import Payback, current_ms, planned_ms


@pytest.mark.parametrize("now, planned, cost, worth, saved", [
    (100.0, 50.0, None, True, 60.0),     # nothing measured yet: the first re-cut goes ahead
    (100.0, 50.0, 30.0, True, 60.0),     # twice as fast: saves 60 s of 120, more than 30
    (100.0, 80.0, 30.0, False, 24.0),    # 20% faster: 24 s saved, less than the 30 s it costs
    (100.0, 120.0, 0.0, False, 0.0),     # slower: saves nothing, even for free
])
def test_a_recut_pays_back_only_when_its_saving_beats_its_measured_cost(now, planned, cost, worth, saved):
    p = Payback(now, planned, cost, 120.0)
    assert p.worth_it is worth and p.saved_s == pytest.approx(saved)
    assert f"saves {saved:.1f} s over 120 s" in p.text()


def test_the_split_serving_now_is_predicted_as_the_planner_predicts_the_same_split(tiny_model, tmp_path):
    """current_ms of the planner's own split at the same speeds is what the planner predicted for it
    (both objectives); a stage whose worker has no measurement gives None (nothing to damp with)."""
    from skippy_zmq.cluster.drift import scale_measure
    from skippy_zmq.cluster.split import plan_measured
    from skippy_zmq.config.topology_yaml import load_topology

    topology = load_topology(recut_topology(tmp_path, tiny_model, 2))
    measured = {"a": fake_measure(8 << 30), "b": scale_measure(fake_measure(8 << 30), 3.0)}
    for objective in ("latency", "throughput"):
        split = plan_measured(topology, measured, objective, 8)
        assert [s.end - s.start for s in split.topology.stages] != [2, 2]   # b is slower: it got fewer
        now = current_ms(split.topology, list(split.workers), measured, objective, 8)
        assert now == pytest.approx(planned_ms(split.prediction, objective)) and now > 0
        even = current_ms(topology, list(split.workers), measured, objective, 8)   # the even split [0,2) [2,4)
        assert even > now
    assert current_ms(topology, ["a", None], measured, "latency", 8) is None
    assert current_ms(topology, ["a", "gone"], measured, "latency", 8) is None
