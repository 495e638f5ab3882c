"""scripts/token_breakdown.py: the medians it takes from the stages' per-hop traces."""

from __future__ import annotations


import pytest
from scripts_helper import load_script


@pytest.fixture(scope="module")
def tb():
    return load_script("token_breakdown")


def step(start_ms: float, stages: list[tuple[float, float, float]]) -> list[dict]:
    """One step's trace: per stage (ms after the previous stage's send to receive, ms held, compute ms)."""
    trace, t = [], start_ms
    for i, (gap, held, compute) in enumerate(stages):
        recv = t + gap
        trace.append({"stage": f"s{i}", "recv_ns": int(recv * 1e6), "send_ns": int((recv + held) * 1e6),
                      "compute_ms": compute, "rows": 1})
        t = recv + held
    return trace


def test_two_stages_split_into_compute_own_hop_and_round(tb):
    # each step: s0 holds 4 ms (3.5 compute), 0.4 ms to s1, s1 holds 5 ms (4.5 compute); the next step
    # reaches s0 1 ms after s1 sent (the round through the driver): 10.4 ms a token
    steps = [step(10.4 * k, [(0.0, 4.0, 3.5), (0.4, 5.0, 4.5)]) for k in range(5)]
    got = tb.breakdown(steps, [10.4, 10.5, 10.3])
    assert got["interval"] == 10.4
    assert got["compute"] == {"s0": 3.5, "s1": 4.5}
    assert got["own"] == pytest.approx({"s0": 0.5, "s1": 0.5})
    assert got["hops"] == [pytest.approx(0.4)]
    assert got["round"] == pytest.approx(1.0)


def test_one_stage_has_no_hop(tb):
    steps = [step(8.0 * k, [(0.0, 7.0, 6.5)]) for k in range(3)]
    got = tb.breakdown(steps, [8.0])
    assert got["hops"] == [] and got["round"] == pytest.approx(1.0) and got["own"] == pytest.approx({"s0": 0.5})
