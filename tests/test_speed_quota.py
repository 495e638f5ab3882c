"""ops/speed.py's model of hosts under a CPU quota: a step started idle bursts (1 stream, and at
many streams a host that is not the round's bottleneck), the round's bottleneck runs at its
sustained speed; and the quiet `bench cluster` run's splits rebuilt from its recorded
measurements, every row predicted within the issue's 0.85-1.15 of what it measured. Pure
arithmetic: no processes, no JAX."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from skippy_zmq.cluster.measure import CFS_KEEP_MS, quota_burst
from skippy_zmq.devtools.bench.cluster import driver_links, many_rows
from skippy_zmq.devtools.split_search import brute_force
from skippy_zmq.ops.speed import (HostSpeed, Links, Stage, objective_ms, plan_split, predict,
                                  throttled_ms)

RUN = Path(__file__).parent / "fixtures" / "cluster_quiet_run.json"
# the later quiet run (then docs/cluster.md "Figures", 8433568; git log -- docs/cluster.md): its latency and throughput plans
# predicted 16.80 / 16.81 ms at 1 stream and measured 18.23 / 15.66
FINAL_RUN = Path(__file__).parent / "fixtures" / "cluster_final_run.json"
# the 1-stream rerun (docs/cluster.md "A 1-stream rerun" before 02265cb, 23:43): the even split measured 41.72 ms
RERUN = Path(__file__).parent / "fixtures" / "cluster_rerun_run.json"
# the run after the runtime was carried (docs/cluster.md, 2026-12-06 05:28): even split 31.28 ms
CHECK_RUN = Path(__file__).parent / "fixtures" / "cluster_check_run.json"
# the first run with CPU figures (then docs/cluster.md "Figures", 2026-12-06 08:45)
CPU_RUN = Path(__file__).parent / "fixtures" / "cluster_cpu_run.json"
UNHELD_RUN = Path(__file__).parent / "fixtures" / "cluster_unheld_run.json"


def quiet_run(path: Path | None = None) -> tuple[dict, dict[str, HostSpeed], Links]:
    """The recorded run's hosts as bench cluster builds them now (its many-row mean, the quota's
    burst from measure.quota_burst) and its links with the ring's driver and hop software."""
    run = json.loads((path or RUN).read_text())
    hosts = {}
    for name, h in run["hosts"].items():
        m = many_rows(copy.deepcopy(h["alone"]), h["together"])
        m.update(quota_burst(m["cpu_quota_cores"], m["cpu_period_ms"]))
        hosts[name] = HostSpeed.from_measure(m, 4 << 30)
    links = dataclasses.replace(driver_links(run["links"]), **run["ring"])
    return run, hosts, links


def stages_of(label: str) -> tuple[Stage, ...]:
    out, start = [], 0
    for part in label.split(" / "):
        host, n = part.split(":")
        out.append(Stage(host, start, start + int(n)))
        start += int(n)
    return tuple(out)


def test_the_quiet_runs_splits_are_predicted_within_15_percent():
    """Predicted ÷ measured in every row of the quiet run (ms per token at 1 stream, tok/s at 8)
    within 0.85-1.15 (it was 1.17-1.43 and 0.81-0.96 when a 25% host's idle start measured 1.0
    and every many-row step took the all-busy figures)."""
    run, hosts, links = quiet_run()
    ratios = {}
    for row in run["splits"]:
        p = predict(stages_of(row["layers"]), hosts, run["n_layers"], links, run["streams"], run["row_bytes"])
        ratios[row["split"]] = (round(p.ms_per_token_1 / row["ms_per_token_1"], 3),
                                round(p.tok_s_n / row["tok_s_8"], 3))
    assert all(0.85 <= r <= 1.15 for pair in ratios.values() for r in pair), ratios


def test_the_quiet_runs_plan_is_brute_forces():
    run, hosts, links = quiet_run()
    need = lambda a, b: 0   # noqa: E731  (memory: every host holds the model)
    for objective in ("latency", "throughput"):
        got = plan_split(list(hosts.values()), run["n_layers"], need, links, objective, 8, 3, run["row_bytes"], tie=0)
        want = brute_force(list(hosts.values()), run["n_layers"], need, links, objective, 8, 3, run["row_bytes"])
        assert objective_ms(got.stages, hosts, run["n_layers"], links, objective, 8, run["row_bytes"]) == \
            pytest.approx(objective_ms(want.stages, hosts, run["n_layers"], links, objective, 8, run["row_bytes"]))


@pytest.mark.parametrize("path", [RUN, FINAL_RUN], ids=["quiet", "final"])
def test_the_1_stream_plan_is_within_5_percent_of_the_best_measured_split(path):
    """Issue 40's planned ÷ best measured >= 0.95 at 1 stream, on both recorded runs: the final
    run's latency and throughput plans predict 0.06% apart (a tie: TIE) and the throughput plan,
    8 streams' best, measured best at 1 stream too; the quiet run's latency plan is 4.5% ahead
    of its throughput plan by prediction, past a tie, and stays (it measured best)."""
    run, hosts, links = quiet_run(path)
    need = lambda a, b: 0   # noqa: E731
    plan = plan_split(list(hosts.values()), run["n_layers"], need, links, "latency", 8, 3, run["row_bytes"])
    measured = {row["layers"]: row["ms_per_token_1"] for row in run["splits"]}
    label = " / ".join(f"{s.host}:{s.end - s.start}" for s in plan.stages)
    assert min(measured.values()) / measured[label] >= 0.95, (label, measured)
    exact = plan_split(list(hosts.values()), run["n_layers"], need, links, "latency", 8, 3, run["row_bytes"], tie=0)
    assert (exact.stages != plan.stages) == (path == FINAL_RUN)   # the tie-break decided only the final run


def test_the_quota_burst_of_a_host():
    assert quota_burst(0.25, 10.0) == {"idle_ratio": 0.25, "burst_ms": 2.5 + CFS_KEEP_MS}
    assert quota_burst(0.5, 10.0) == {"idle_ratio": 0.5, "burst_ms": 5.0 + CFS_KEEP_MS}
    assert quota_burst(1.0, 10.0) == quota_burst(2.0, 10.0) == {"idle_ratio": 1.0, "burst_ms": 0.0}   # a core: no burst
    assert quota_burst(0.25, 0.0)["idle_ratio"] == 1.0


def test_a_step_just_over_the_budget_runs_flat_out_on_the_cores_leftover():
    """2.54 ms of work at 25% of a 10 ms period: over the 2.5 ms budget by a hair, it waited for
    the next period in most phases (5.6 ms predicted, 2.5 measured); the runtime the kernel leaves
    on the core covers it. A long step still runs at the quota: the overrun is paid back."""
    assert throttled_ms(2.54, 0.25, 10.0) > 5.0
    assert throttled_ms(2.4, 0.25, 10.0, 3.5) == pytest.approx(2.4)            # within the budget
    # over it by a hair: flat out unless the core kept none (1 of the 4 overruns averaged)
    assert throttled_ms(2.54, 0.25, 10.0, 3.5) == pytest.approx((throttled_ms(2.54, 0.25, 10.0) + 3 * 2.54) / 4)
    # the planner is not pushed to the edge: a step that needs all of the overrun mostly stalls
    assert throttled_ms(3.45, 0.25, 10.0, 3.5) > 1.5 * 3.45
    long, plain = throttled_ms(50.0, 0.25, 10.0, 3.5), throttled_ms(50.0, 0.25, 10.0)
    assert plain - 10 <= long <= plain            # 20 periods of budget: the first one's extra is paid back
    assert throttled_ms(8.6, 0.25, 10.0, 3.5) == pytest.approx(throttled_ms(8.6, 0.25, 10.0), abs=1.0)


def test_at_many_streams_a_quota_d_host_bursts_unless_it_bounds_the_round():
    """Three stages, 8 streams: a 25%-quota host holding little is idle most of each round, so its
    steps run flat out; the same host holding most is the bottleneck and runs at its sustained
    rate (the round is M × its step). A slow host without a quota never bursts."""
    fast = HostSpeed("fast", (1, 4), (0.5, 1.0), (0.2, 0.2), (2.0, 4.0))
    slow = HostSpeed("slow", (1, 4), (2.0, 4.0), (0.4, 0.4), (8.0, 16.0), idle_ratio=0.25, period_ms=10.0,
                     burst_ms=3.5)
    plain = dataclasses.replace(slow, name="plain", idle_ratio=1.0, period_ms=0.0, burst_ms=0.0)
    hosts = {h.name: h for h in (fast, slow, plain)}
    light = predict((Stage("slow", 0, 1), Stage("fast", 1, 20)), hosts, 20, Links())
    steady = slow.stage_ms(1, False, 4)
    assert light.stage_ms_n[0] == pytest.approx(throttled_ms(steady * 0.25, 0.25, 10.0, 3.5))
    assert light.stage_ms_n[0] < steady
    assert light.round_ms_n == pytest.approx(max(sum(light.stage_ms_n), 2 * light.stage_ms_n[1]))
    heavy = predict((Stage("fast", 0, 2), Stage("slow", 2, 20)), hosts, 20, Links())
    assert heavy.stage_ms_n[1] == pytest.approx(slow.stage_ms(18, True, 4))
    assert heavy.round_ms_n == pytest.approx(2 * heavy.stage_ms_n[1])
    same = predict((Stage("plain", 0, 1), Stage("fast", 1, 20)), hosts, 20, Links())
    assert same.stage_ms_n[0] == pytest.approx(plain.stage_ms(1, False, 4))


def test_the_reruns_latency_plan_leaves_the_quota_hosts_out():
    """The 23:43 rerun: held to all three hosts the 1-stream plan was h50:11 / h25:1 / h100:18,
    predicted 21.1 ms (measured 21.93); h100 alone was predicted 18.64 (its one-stage ring
    measured 19.86), and bench cluster's plan may leave hosts out as plan_split does."""
    from skippy_zmq.devtools.bench.cluster import plan_splits

    run, hosts, links = quiet_run(RERUN)
    need = lambda a, b: 0   # noqa: E731  (memory: every host holds the model)
    three = plan_split(list(hosts.values()), run["n_layers"], need, links, "latency", 8, 3, run["row_bytes"])
    assert stages_of("h50:11 / h25:1 / h100:18") == three.stages
    assert three.ms_per_token_1 == pytest.approx(21.10, abs=0.01)
    splits = plan_splits(list(hosts.values()), run["n_layers"], need, links, run["row_bytes"])
    assert splits["planned (latency)"] == (Stage("h100", 0, 30),)
    alone = predict(splits["planned (latency)"], hosts, run["n_layers"], links, 8, run["row_bytes"])
    assert alone.ms_per_token_1 == pytest.approx(18.64, abs=0.01)
    assert len(splits["even"]) == 3


@pytest.mark.parametrize("path, latency, throughput, tok_s", [
    (CPU_RUN, "h100:30", "h100:30", 164.8),      # h100:24 / h50:6 predicted 168.3: within FEWER
    (RERUN, "h100:30", "h100:30", 159.8),        # h50:12 / h100:18 165.3
    (CHECK_RUN, "h100:30", "h100:30", 151.3),
    (UNHELD_RUN, "h100:30", "h100:30", 154.1),   # h50:13 / h100:17 161.0 (measured 137.0; h100 alone 169.7)
], ids=["cpu", "rerun", "check", "unheld"])
def test_the_throughput_plan_may_leave_hosts_out_and_the_grid_still_has_splits(path, latency, throughput, tok_s):
    """bench cluster's 8-stream plan is no longer held to three hosts (the 08:45 run's held plan
    h50:10 / h25:5 / h100:15 measured 121.9 tok/s, h100 alone 179.6); the grid gets the best
    predicted order of every host count from two up, so where both plans are h100 alone (the 05:28
    run) it still tries 2- and 3-host splits."""
    from skippy_zmq.devtools.bench.cluster import grid_orders, plan_splits

    run, hosts, links = quiet_run(path)
    need = lambda a, b: 0   # noqa: E731
    splits = plan_splits(list(hosts.values()), run["n_layers"], need, links, run["row_bytes"])
    assert (splits["planned (latency)"], splits["planned (throughput)"]) == (stages_of(latency), stages_of(throughput))
    p = predict(splits["planned (throughput)"], hosts, run["n_layers"], links, 8, run["row_bytes"])
    assert p.tok_s_n == pytest.approx(tok_s, abs=0.05)
    orders = grid_orders(list(hosts.values()), run["n_layers"], need, links, run["row_bytes"])
    assert {len(o) for o in orders} == {2, 3} and len(set(orders)) == len(orders)
