"""ops/cfs.py: one stream round a ring of hosts under CPU quotas, followed token by token."""

from __future__ import annotations

import pytest

from skippy_zmq.ops.cfs import Step, ring_1, throttled_ms
from test_speed_quota import FINAL_RUN, RUN, quiet_run, stages_of

from skippy_zmq.ops.speed import predict


def test_without_a_quota_the_ring_is_its_sum():
    token, walls = ring_1([Step(3.0), Step(5.5)], [0.25, 0.5, 0.25], driver_ms=0.1)
    assert walls == (3.0, 5.5)
    assert token == pytest.approx(3.0 + 5.5 + 1.0 + 0.1)


def test_a_step_held_at_its_budget_locks_the_token_to_whole_periods():
    # 4.5 ms of work on a host at 25% of a core (2.5 ms budget a 10 ms period, up to 1 ms kept), then
    # 14.5 ms elsewhere: held at its budget, it finishes r ms after its period ends and starts again
    # r + 14.5 ms later, 5.5 ms before the next end, held again: 5.5 ms a step, 20 ms a token
    token, walls = ring_1([Step(4.5, 0.25, 10.0, 3.5), Step(14.5)], [0.0, 0.0, 0.0])
    assert walls[0] == pytest.approx(5.5)
    assert token == pytest.approx(20.0)
    # averaged over phases instead, as a search sums it: the same step 8.1 ms
    assert throttled_ms(4.5, 0.25, 10.0, 3.5) == pytest.approx(8.07, abs=0.01)


def test_a_step_within_its_burst_runs_flat_out():
    token, walls = ring_1([Step(2.0, 0.25, 10.0, 3.5), Step(9.0)], [0.5, 0.5, 0.5])
    assert walls[0] == pytest.approx(2.0)
    assert token == pytest.approx(12.5)


@pytest.mark.parametrize("path", [RUN, FINAL_RUN], ids=["quiet", "final"])
def test_the_recorded_even_split_is_predicted_within_one_percent(path):
    """The even split's host at 25% runs 10 layers and the head, held at its budget every token:
    the token locks to 4 periods (measured 39.94 and 39.96 ms; the phase average said 38.9, 38.3)."""
    run, hosts, links = quiet_run(path)
    row = next(r for r in run["splits"] if r["split"] == "even")
    p = predict(stages_of(row["layers"]), hosts, run["n_layers"], links, run["streams"], run["row_bytes"])
    assert p.ms_per_token_1 == pytest.approx(row["ms_per_token_1"], rel=0.01)
