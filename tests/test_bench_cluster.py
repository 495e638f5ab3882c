"""`bench cluster`'s arithmetic: the even and grid splits it runs, and its goal rows."""

from __future__ import annotations

from skippy_zmq.devtools.bench.cluster import even_ranges, goal_rows, grid_splits, software_ms, stage_step_ms
from skippy_zmq.ops.speed import Stage


def test_even_and_grid_splits_cover_the_layers():
    assert even_ranges(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert even_ranges(10, 3) == [(0, 3), (3, 7), (7, 10)]
    grid = grid_splits(["a", "b", "c"], 30, 6)           # cuts on 6, 12, 18, 24: C(4, 2) splits
    assert len(grid) == 6 and grid[0] == (Stage("a", 0, 6), Stage("b", 6, 12), Stage("c", 12, 30))
    assert all(s[0].start == 0 and s[-1].end == 30 and [x.host for x in s] == ["a", "b", "c"] for s in grid)


def test_goal_rows_compare_planned_with_even_and_the_best_measured():
    rows = [{"split": "planned (latency)", "ms_per_token_1": 20.0, "tok_s_8": 80.0, "pred_over_meas_1": 1.1,
             "pred_over_meas_8": 1.5},
            {"split": "planned (throughput)", "ms_per_token_1": 25.0, "tok_s_8": 120.0, "pred_over_meas_1": 0.9,
             "pred_over_meas_8": 1.2},
            {"split": "even", "ms_per_token_1": 50.0, "tok_s_8": 40.0, "pred_over_meas_1": 0.95,
             "pred_over_meas_8": None},
            {"split": "grid 9 / 3 / 18", "ms_per_token_1": 19.0, "tok_s_8": 125.0}]
    goals = {g["check"]: g["measured"] for g in goal_rows(rows)}
    assert goals["1 stream: planned / even split (tok/s)"] == 2.5
    assert goals["1 stream: planned / best measured split"] == round(19 / 20, 3)
    assert goals["8 streams: planned / best measured split"] == round(120 / 125, 3)
    assert goals["predicted / measured, every row"] == "0.90-1.50"


def test_stage_step_ms_is_each_stages_median_compute():
    traces = [[{"stage": "s0", "compute_ms": 1.0}, {"stage": "s1", "compute_ms": 4.0}],
              [{"stage": "s0", "compute_ms": 3.0}, {"stage": "s1", "compute_ms": 6.0}],
              [{"stage": "s0", "compute_ms": 2.0}]]
    assert stage_step_ms(traces, ("s0", "s1", "s2")) == [2.0, 5.0, 0.0]


def test_software_ms_splits_a_token_into_own_transit_and_the_driver():
    # s0 receives at 0 and sends at 4 ms (3.5 computing), s1 receives 0.4 ms later and sends 5 ms after
    ms = 1_000_000
    step = [{"stage": "s0", "recv_ns": 0, "send_ns": 4 * ms, "compute_ms": 3.5},
            {"stage": "s1", "recv_ns": int(4.4 * ms), "send_ns": int(9.4 * ms), "compute_ms": 4.5}]
    assert software_ms([step, step, [{"stage": "s0", "compute_ms": 1.0}]], ("s0", "s1"), 10.4) == \
        {"stage_sw_ms_1": "0.50 / 0.50", "transit_ms_1": "0.40", "driver_ms_1": 1.0}
    assert software_ms([[{"stage": "s0", "compute_ms": 1.0}]], ("s0", "s1"), 10.4) == {}


def test_the_recut_rows_windows_and_goals():
    from skippy_zmq.devtools.bench.cluster_recut import recut_goals, window_rate

    times = [[0.0, 0.5, 1.0, 1.5, 2.0], [0.1, 1.1, 2.1]]            # two streams: gaps of 0.5 and 1.0 s
    w = window_rate(times, 0.0, 2.0)
    assert w == {"tok_s": 3.0, "ms_per_token": 500.0, "tokens": 6, "seconds": 2.0}   # [0, 2): 2.0 and 2.1 out
    assert window_rate(times, 5.0, 6.0) == {"tok_s": 0.0, "ms_per_token": None, "tokens": 0, "seconds": 1.0}
    row = {"streams": 8, "failed": 0, "identical": 8, "without": {"tok_s": 40.0}, "after": {"tok_s": 56.0}}
    goals = recut_goals(row)
    assert [g["met"] for g in goals] == [True, True, True] and goals[-1]["measured"] == 1.4
    row.update(failed=1, identical=7, after={"tok_s": 48.0})
    goals = recut_goals(row)
    assert [g["measured"] for g in goals] == [1, "7/8", 1.2] and not any(g["met"] for g in goals)
    row.update(failed=0, identical=8, gone_reason="worker b (stage s1, layers [25, 30)) is gone")
    goals = recut_goals(row)
    assert goals[-1]["measured"] == "0; 8/8" and goals[-1]["met"]


def test_the_machine_speed_probe_is_a_positive_median():
    from skippy_zmq.devtools.bench.cluster_ring import machine_ms

    assert machine_ms(0.01) > 0.0
