"""ops/speed.py's stage times against every recorded `bench cluster` run that has the stages' own
telemetry: is a partial stack predicted too slow? Each stage's served compute (the median of its
decode steps' compute_ms at 1 stream) beside what the model composes from its host's measurement
(a step's fixed cost + layers x the per-layer slope, + the head on the last stage; x the quota
where the step runs within its burst). Pure arithmetic over the fixtures: no processes, no JAX."""

from __future__ import annotations

import statistics

import pytest

from pathlib import Path

from test_speed_quota import CHECK_RUN, FINAL_RUN, RERUN, RUN, UNHELD_RUN, quiet_run, stages_of

from skippy_zmq.cluster.drift import scale_measure
from skippy_zmq.cluster.measure import CFS_KEEP_MS, quota_burst
from skippy_zmq.ops.speed import HostSpeed, predict

# the run docs/cluster.md "Figures" tabulated then (2026-12-05 20:53, 63833fd; git log -- docs/cluster.md): 11 splits, 1 and 8 streams
FIGURES_RUN = Path(__file__).parent / "fixtures" / "cluster_figures_run.json"
# the first run with CPU figures (2026-12-06 08:45, then docs/cluster.md "Figures"), quiet
CPU_RUN = Path(__file__).parent / "fixtures" / "cluster_cpu_run.json"


def _served_vs_composed(path: Path) -> list[tuple[str, int, bool, float]]:
    """(host, layers, holds the head, served ÷ composed) of every stage served within its quota's
    budget (a step held by its quota is ops/cfs's question, not the composition's)."""
    run, hosts, _ = quiet_run(path)
    out = []
    for row in run["splits"]:
        if not row.get("step_ms_1"):
            continue
        for stage, served in zip(stages_of(row["layers"]), map(float, row["step_ms_1"].split(" / "))):
            h, n = hosts[stage.host], stage.end - stage.start
            last = stage.end == run["n_layers"]
            head = h.at(h.head_ms, 1) if last else 0.0
            # the compute alone: a step's message and the stage's software are outside compute_ms
            work = (h.at(h.step_ms, 1) - _message(run, stage.host)) + n * h.at(h.layer_ms, 1) + head
            work *= h.idle_ratio if h.bursts else 1.0
            if h.bursts and served > h.burst_ms - CFS_KEEP_MS:   # held at the period's budget
                continue
            out.append((stage.host, n, last, served / work))
    return out


def _message(run: dict, host: str) -> float:
    return float(run["hosts"][host]["alone"]["decode"]["1"].get("message_ms", 0.0))


def test_partial_stacks_are_composed_right_where_the_measurement_held():
    """The two runs whose measurement held (Figures, the 23:43 rerun): a partial stack is served
    within 0.93-1.25 of its composed time, with no trend toward the full stack (the composition is
    a measured fixed cost + a measured slope, exact at the model's depth by construction: the stack
    measured is all 30 layers)."""
    for path in (FIGURES_RUN, RERUN):
        ratios = [r for host, n, last, r in _served_vs_composed(path) if n < 30 and n > 1]
        assert 0.98 <= statistics.median(ratios) <= 1.10, ratios
        assert all(0.9 <= r <= 1.26 for r in ratios), ratios
        short = [r for host, n, last, r in _served_vs_composed(path) if 1 < n <= 12]
        long = [r for host, n, last, r in _served_vs_composed(path) if n > 12]
        # short stacks are not the ones predicted slow (that would be a fixed cost counted per layer)
        assert statistics.median(short) >= statistics.median(long) - 0.02


def test_the_check_runs_partial_stacks_were_served_faster_than_every_host_measured():
    """The 05:28 run (planned throughput predicted 19.7 ms, served 16.31): its partial stacks on
    every host served at 0.75-0.93 of their composition (h100's 10 layers as s0, 1.03: first stages
    serve 0.3-0.8 ms slower in every run), its full stack at 0.98; its lone measurement
    disagreed with its all-busy one minutes later by more than the other runs' sessions did (h50's
    one-layer call 3.33 ms alone against 1.72 all busy; h100's head 2.53 against 4.24), where in the
    Figures run the lone and all-busy calls agreed within 20%."""
    got = _served_vs_composed(CHECK_RUN)
    partial = [r for host, n, last, r in got if n < 30]
    full = [r for host, n, last, r in got if n == 30]
    assert statistics.median(partial) < 0.87 and max(partial) < 1.05 and min(partial) > 0.7, partial
    assert full == [pytest.approx(0.975, abs=0.01)]
    run, _, _ = quiet_run(CHECK_RUN)
    h50 = run["hosts"]["h50"]
    one = lambda d: d["1"]["step_ms"] + d["1"]["layer_ms"]   # noqa: E731
    assert one(h50["alone"]["decode"]) / one(h50["together"]["decode"]) == pytest.approx(1.94, abs=0.01)


@pytest.mark.parametrize("path, want_1, want_8", [
    (RUN, (0.854, 1.112), (0.922, 1.045)),
    (FINAL_RUN, (0.771, 1.349), (0.883, 1.165)),
    (FIGURES_RUN, (0.810, 1.120), (0.883, 1.075)),
    (RERUN, (0.962, 1.075), None),
    (CHECK_RUN, (0.985, 1.208), None),
    (CPU_RUN, (0.953, 1.198), (0.864, 1.068)),
    (UNHELD_RUN, (0.787, 1.127), (0.908, 1.175)),   # h100 alone at 8: 0.830 with the blended figures
], ids=["quiet", "final", "figures", "rerun", "check", "cpu", "unheld"])
def test_every_recorded_rows_prediction(path, want_1, want_8):
    """Predicted ÷ measured of every row of every recorded run as the model stands (the range of
    each run: docs/cluster.md "What the time model counts" names the rows out and why)."""
    run, hosts, links = quiet_run(path)
    one, many = [], []
    for row in run["splits"]:
        p = predict(stages_of(row["layers"]), hosts, run["n_layers"], links, run["streams"], run["row_bytes"])
        one.append(p.ms_per_token_1 / row["ms_per_token_1"])
        if row.get("tok_s_8"):
            many.append(p.tok_s_n / row["tok_s_8"])
    assert (min(one), max(one)) == pytest.approx(want_1, abs=0.001)
    if want_8 is not None:
        assert (min(many), max(many)) == pytest.approx(want_8, abs=0.001)


def _measured(quota: float, cpu: bool) -> dict:
    """A measure_host result of a host at `quota` cores (its 1-row clock figures a loaded loop's)."""
    row = {"layer_ms": 2.1, "step_ms": 2.93, "head_ms": 16.05, "sample_ms": 0.01, "message_ms": 0.2, "software_ms": 1.0}
    if cpu:
        row["cpu"] = {"layer_ms": 0.33, "step_ms": 0.35, "head_ms": 3.2}
    many = {"layer_ms": 5.0, "step_ms": 1.0, "head_ms": 30.0, "cpu": {"layer_ms": 1.2, "step_ms": 0.2, "head_ms": 7.0}}
    out = {"name": "h", "decode": {"1": row, "4": dict(many), "8": dict(many)}, "cpu_period_ms": 10.0}
    out.update(quota_burst(quota, 10.0))
    return out


def test_a_quotad_hosts_idle_started_step_is_its_cpu_time():
    """Under a quota below a core the 1-row figures come from the measured CPU: a step started idle
    is that much work (e = q), its sustained time that over the quota; the many-row figures (a
    busy host's) and a host without a quota keep the clock's."""
    h = HostSpeed.from_measure(_measured(0.25, cpu=True))
    want = (0.33 / 0.25, 0.35 / 0.25 + 0.2, 3.2 / 0.25 + 0.01)    # (+ the message, + the sampling)
    assert (h.layer_ms[0], h.step_ms[0], h.head_ms[0]) == pytest.approx(want)
    assert h.step(3, False).work_ms == pytest.approx(0.35 + 3 * 0.33 + 0.25 * (0.2 + 1.0))
    assert (h.layer_ms[1], h.head_ms[2]) == (5.0, 30.0)     # (no sample_ms in the many-row rows here)
    clock = HostSpeed.from_measure(_measured(0.25, cpu=False))
    assert clock.step(3, False).work_ms == pytest.approx(0.25 * (2.93 + 0.2 + 1.0 + 3 * 2.1))
    whole = HostSpeed.from_measure(_measured(1.0, cpu=True))
    assert (whole.layer_ms[0], whole.step_ms[0]) == (2.1, 2.93 + 0.2)


def test_drift_scales_the_cpu_figures_too():
    out = scale_measure(_measured(0.25, cpu=True), 2.0)
    assert out["decode"]["1"]["cpu"] == pytest.approx({"layer_ms": 0.66, "step_ms": 0.7, "head_ms": 6.4})
    assert HostSpeed.from_measure(out).layer_ms[0] == pytest.approx(2 * 0.33 / 0.25)


def _h100_factor(run: dict, hosts: dict, row: dict) -> float | None:
    """The unquota'd host's served ÷ composed 1-row compute in a row (no burst, no quota: what it
    says is the machine's speed then against when it was measured); None where h100 is a first stage
    of several (it then also embeds: served 0.3-0.8 ms over its composition in every run)."""
    stages = stages_of(row["layers"])
    for i, (stage, served) in enumerate(zip(stages, map(float, row["step_ms_1"].split(" / ")))):
        if stage.host == "h100" and (i > 0 or len(stages) == 1):
            h, n = hosts["h100"], stage.end - stage.start
            head = h.at(h.head_ms, 1) if stage.end == run["n_layers"] else 0.0
            return served / (h.at(h.step_ms, 1) - _message(run, "h100") + n * h.at(h.layer_ms, 1) + head)
    return None


def _rows(path: Path) -> list[tuple[str, float, float, float | None]]:
    """(layers, h100's factor, predicted ÷ measured at 1 stream, at 8 streams) of every row with one."""
    run, hosts, links = quiet_run(path)
    out = []
    for row in run["splits"]:
        f = _h100_factor(run, hosts, row)
        if f is None:
            continue
        p = predict(stages_of(row["layers"]), hosts, run["n_layers"], links, run["streams"], run["row_bytes"])
        out.append((row["layers"], f, p.ms_per_token_1 / row["ms_per_token_1"],
                    p.tok_s_n / row["tok_s_8"] if row.get("tok_s_8") else None))
    return out


def test_the_rows_out_of_range_are_the_rows_the_machine_ran_faster_than_measured():
    """Issue 40's predicted ÷ measured misses (the 08:45 run's 1.12-1.14 at 1 stream and 0.866-0.911
    at 8; the 05:28 run's 1.127 and 1.208) are the rows where h100, which has no quota, served its
    own stage at 0.83-0.87 of its measurement: the same rows, with the same stage times predicted,
    where h50's long steps served 0.78-0.81 of theirs. Where h100 served 1.00-1.02 of its measurement
    every row is within 0.95-1.07. The machine's speed moved between the measurement and the row
    (the same h100 stage, 15 layers and the head last of three, served 6.9 ms in one row and 6.0 in
    another), which no composition of the measured figures can follow."""
    cpu = _rows(CPU_RUN)
    fast = [(r1, r8) for _, f, r1, r8 in cpu if f < 0.9]
    even = [(r1, r8) for _, f, r1, r8 in cpu if f >= 0.99]
    assert len(fast) == 3 and len(even) == 3
    assert min(r1 for r1, _ in fast) > 1.12 and max(r8 for _, r8 in fast) < 0.92   # h100:30's 0.918 (alone)
    assert all(0.95 <= r1 <= 1.01 and 0.91 <= r8 <= 1.07 for r1, r8 in even), even
    check = _rows(CHECK_RUN)
    assert sorted(r1 for _, f, r1, _ in check if f < 0.9) == pytest.approx([1.127, 1.208], abs=0.001)
    assert [r1 for _, f, r1, _ in check if f >= 0.9] == pytest.approx([0.985], abs=0.001)
    run, _, _ = quiet_run(CPU_RUN)
    by = {row["split"]: row for row in run["splits"]}
    last = lambda row: (row["step_ms_1"].split(" / ")[-1], row["predicted_step_ms_1"].split(" / ")[-1])  # noqa: E731
    assert last(by["planned (throughput)"]) == ("6.9", "7.1") and last(by["grid 12 / 3 / 15"]) == ("6.0", "7.1")


def test_a_quotad_hosts_long_steps_miss_by_the_rows_speed_and_a_little_more():
    """The 08:45 run's h50 (CPU figures from its throttled loop): served ÷ composed 0.78-1.05, the
    long steps lowest (12 layers 0.80, 9 0.81; 16 0.78 in the memory-only row, where h100 is a
    first stage and gives no factor); divided by h100's factor in the same row 0.92-1.05: what is
    left is within the few percent to 15% a throttled loop adds to the CPU of the same calls
    (docs/cluster.md "Why the rows miss" before 02265cb)."""
    run, hosts, _ = quiet_run(CPU_RUN)
    factor = {row["layers"]: _h100_factor(run, hosts, row) for row in run["splits"]}
    h50 = {}
    for row in run["splits"]:
        for stage, served in zip(stages_of(row["layers"]), map(float, row["step_ms_1"].split(" / "))):
            if stage.host == "h50" and factor[row["layers"]] is not None:
                h = hosts["h50"]
                work = (h.at(h.step_ms, 1) - _message(run, "h50") + (stage.end - stage.start) * h.at(h.layer_ms, 1))
                h50[stage.end - stage.start] = (served / (work * h.idle_ratio), factor[row["layers"]])
    assert sorted(h50) == [3, 6, 9, 10, 12]
    assert [round(h50[n][0], 2) for n in (3, 6, 9, 10, 12)] == [1.05, 0.97, 0.81, 0.94, 0.80]
    assert all(0.91 <= r / f <= 1.06 for r, f in h50.values()), h50


def test_two_stage_rows_at_8_streams_are_over_predicted_as_their_stages_balance():
    """The unheld run's six two-host splits at 8 streams: the model's round is max(the ring's sum,
    M x the slowest step), with M = 2 micro-batches for 2 stages, exact for steady step times. The
    more alike the two stages' steps, the less slack either has for the other's jitter, and the
    further the served round falls short of that bound: predicted ÷ measured rises with the
    balance (the shorter predicted step ÷ the longer): 0.93-1.02 below 0.4, 1.08-1.18 above 0.7."""
    run, hosts, links = quiet_run(UNHELD_RUN)
    pairs = []
    for row in run["splits"]:
        stages = stages_of(row["layers"])
        if len(stages) != 2 or not row.get("tok_s_8"):
            continue
        p = predict(stages, hosts, run["n_layers"], links, run["streams"], run["row_bytes"])
        pairs.append((min(p.stage_ms_n) / max(p.stage_ms_n), p.tok_s_n / row["tok_s_8"]))
    pairs.sort()
    assert len(pairs) == 6
    # the three least balanced (h50 with 3-9 layers) within 0.93-1.02, the three most (12-15) 1.07-1.18
    assert [b < 0.4 for b, _ in pairs] == [True] * 3 + [False] * 3, pairs
    assert max(r for _, r in pairs[:3]) <= 1.02 < 1.07 <= min(r for _, r in pairs[3:]), pairs
