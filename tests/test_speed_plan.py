"""The split by measured speed (ops/speed.py): exact against brute force over every order and
cut, under memory caps, for latency and throughput; its predictions; and `plan --hosts` writing
a topology the loader accepts."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from skippy_zmq.config.topology_yaml import load_topology
from skippy_zmq.ops.cfs import Step, ring_1
from skippy_zmq.devtools.split_search import brute_force
from skippy_zmq.ops.speed import (DRIVER, FEWER, OBJECTIVES, TIE, HostSpeed, Links, SpeedPlanError, Stage, micro_rows, objective_ms, plan_split, predict, throttled_ms)


def host(name: str, layer: float, step: float = 0.5, head: float = 2.0, memory: int = 0) -> HostSpeed:
    """A host whose 8-row step costs 3x its 1-row step (a CPU's matmuls, roughly)."""
    return HostSpeed(name, (1, 8), (layer, 3 * layer), (step, 1.5 * step), (head, 3 * head), 0.01, memory)


def test_predict_is_the_sum_for_one_stream_and_the_bottleneck_for_many():
    hosts = {"a": host("a", 1.0), "b": host("b", 2.0)}
    stages = (Stage("a", 0, 6), Stage("b", 6, 10))
    p = predict(stages, hosts, 10, Links(0.25), streams=8)
    # a: 0.5 + 6·1.0 = 6.5; b: 0.5 + 4·2.0 + 2.0 (head) = 10.5; ring: 3 hops of 0.25
    assert p.stage_ms_1 == (6.5, 10.5) and p.ms_per_token_1 == pytest.approx(17.75)
    # 8 streams over 2 micro-batches of 4 rows: 3/7 of the way from 1 row to 8
    t = 3 / 7
    assert micro_rows(8, 2) == 4 and micro_rows(8, 3) == 4 and micro_rows(5, 1) == 8 and micro_rows(1, 3) == 1
    many = (0.5 * (1 + 0.5 * t) + 6 * (1 + 2 * t), 0.5 * (1 + 0.5 * t) + 4 * 2 * (1 + 2 * t) + 2 * (1 + 2 * t))
    assert p.stage_ms_n == pytest.approx(many)
    assert p.round_ms_n == pytest.approx(max(sum(many) + 0.75, 2 * max(many)))
    assert p.tok_s_n == pytest.approx(8000 / p.round_ms_n)


@pytest.mark.parametrize("seed", range(12))
def test_plan_split_is_exact_against_brute_force(seed):
    rng = random.Random(seed)
    n_layers = rng.randint(2, 9)
    hosts = [HostSpeed(f"h{i}", (1, 8), (rng.uniform(0.1, 2), rng.uniform(0.3, 6)), (rng.uniform(0, 1), rng.uniform(0, 2)),
                       (rng.uniform(0, 3), rng.uniform(0, 9)), 0.0, rng.choice([0, 0, 5, 8]))
             for i in range(rng.randint(1, 3))]
    need = lambda a, b: (b - a) + (2 if a == 0 else 0) + (1 if b == n_layers else 0)   # noqa: E731
    links = Links(rng.uniform(0, 1), {("h0", "h1"): 3.0, ("driver", "h2"): 2.0})
    by_name = {h.name: h for h in hosts}
    for objective in OBJECTIVES:
        for streams in (1, 8):
            for n_stages in (None, len(hosts)):
                want = brute_force(hosts, n_layers, need, links, objective, streams, n_stages)
                if want is None:
                    with pytest.raises(SpeedPlanError, match="fits their memory"):
                        plan_split(hosts, n_layers, need, links, objective, streams, n_stages)
                    continue
                got = plan_split(hosts, n_layers, need, links, objective, streams, n_stages, tie=0)
                tied = plan_split(hosts, n_layers, need, links, objective, streams, n_stages)
                slack = (1 + TIE) * (1 + FEWER if n_stages is None else 1)   # FEWER: a count left open
                assert objective_ms(tied.stages, by_name, n_layers, links, objective, streams) <= slack * \
                    objective_ms(want.stages, by_name, n_layers, links, objective, streams) + 1e-9
                assert objective_ms(got.stages, by_name, n_layers, links, objective, streams) == pytest.approx(
                    objective_ms(want.stages, by_name, n_layers, links, objective, streams))
                assert all(not by_name[s.host].memory or need(s.start, s.end) <= by_name[s.host].memory
                           for s in got.stages)


def test_software_per_stage_per_hop_and_the_drivers_are_charged():
    """A stage's software per step (measured on its host, part of its step, so a quota'd host's
    burst applies to it too), each hop's fixed software and the driver's time a token. b's step is
    cfs.ring_1's: a token (4.6 ms) is shorter than b's period, and 1.3 ms of work every token is
    more than its 2.5 ms a period, so some steps are held; a step alone (throttled_ms) runs flat out."""
    hosts = {"a": HostSpeed("a", (1,), (1.0,), (0.5,), (2.0,), software_ms=(0.4,)),
             "b": HostSpeed("b", (1,), (1.0,), (0.5,), (2.0,), software_ms=(0.8,), idle_ratio=0.25, period_ms=10.0)}
    stages = (Stage("a", 0, 2), Stage("b", 2, 4))
    bare = predict(stages, hosts, 4, Links(0.25))
    assert bare.stage_ms_1[0] == pytest.approx(0.5 + 0.4 + 2 * 1.0)
    work = (0.5 + 0.8 + 2 + 2) * 0.25
    assert bare.stage_ms_1[1] == pytest.approx(ring_1([Step(2.9), Step(work, 0.25, 10.0)], bare.hop_ms_1)[1][1])
    assert throttled_ms(work, 0.25, 10.0) == pytest.approx(work)
    assert bare.stage_ms_1[1] > work + 0.1
    charged = predict(stages, hosts, 4, Links(0.25, driver_ms=1.5, hop_fixed_ms=0.4))
    # 3 hops, 1 driver; b's step apart, which the longer token lets hold less
    assert charged.ms_per_token_1 - charged.stage_ms_1[1] == pytest.approx(
        bare.ms_per_token_1 - bare.stage_ms_1[1] + 1.5 + 3 * 0.4)
    assert charged.hop_ms_1 == pytest.approx((0.65, 0.65, 0.65))
    # at 8 streams b (25% of a core, 2 layers and the head) bounds the round: M x its sustained step
    assert charged.round_ms_n == bare.round_ms_n == pytest.approx(2 * (0.5 + 0.8 + 2 + 2))
    # more stages pay more hops: with a dear hop the planner keeps the layers together
    dear = plan_split(list(hosts.values())[:1] + [HostSpeed("c", (1,), (1.0,), (0.5,), (2.0,))], 4,
                      lambda a, b: 0, Links(0.0, hop_fixed_ms=5.0))
    assert len(dear.stages) == 1


@pytest.mark.parametrize("seed", range(8))
def test_plan_split_is_exact_with_hop_costs_and_quota_bursts(seed):
    """Bandwidth on some links (so the host order matters) and hosts under a CPU quota (a 1-stream
    step bursts): the DP still finds brute force's optimum."""
    rng = random.Random(100 + seed)
    n_layers = rng.randint(2, 8)
    hosts = [HostSpeed(f"h{i}", (1, 8), (rng.uniform(0.1, 2), rng.uniform(0.3, 6)), (rng.uniform(0, 1), 1.0),
                       (rng.uniform(0, 3), 5.0), 0.0, 0, rng.choice([1.0, 0.25, 0.5]), rng.choice([0.0, 10.0]),
                       burst_ms=rng.choice([0.0, 3.5, 6.0]))
             for i in range(rng.randint(2, 3))]
    need = lambda a, b: b - a   # noqa: E731
    links = Links.from_rtt(rng.uniform(0, 1), {("h0", "h1"): 2.0}, 0.0,
                           {("h0", "h1"): 1e6, (DRIVER, "h1"): 2e6, ("h1", "h2"): 5e5})
    by_name = {h.name: h for h in hosts}
    for objective in OBJECTIVES:
        want = brute_force(hosts, n_layers, need, links, objective, 8, None, row_bytes=2304)
        got = plan_split(hosts, n_layers, need, links, objective, 8, None, row_bytes=2304, tie=0)
        assert objective_ms(got.stages, by_name, n_layers, links, objective, 8, 2304) == pytest.approx(
            objective_ms(want.stages, by_name, n_layers, links, objective, 8, 2304))


def test_a_tie_goes_to_the_split_better_on_the_other_objective():
    """Two splits the model cannot order at 1 stream (within TIE) but far apart at 8 streams: the
    latency plan keeps the one that serves 8 streams faster; beyond TIE the 1-stream optimum
    stays; tie=0 is the exact optimum."""
    fast = HostSpeed("fast", (1, 4), (1.0, 1.2), (0.2, 0.2), (2.0, 2.4))
    slow = HostSpeed("slow", (1, 4), (1.02, 3.0), (0.2, 0.2), (2.0, 6.0))
    hosts, need = [fast, slow], lambda a, b: 0   # noqa: E731
    exact = plan_split(hosts, 10, need, Links(), "latency", 8, 1, tie=0)
    tied = plan_split(hosts, 10, need, Links(), "latency", 8, 1)
    assert [s.host for s in exact.stages] == ["fast"] and [s.host for s in tied.stages] == ["fast"]
    # slow at 1 row within 2% of fast, 2.5x slower at 4 rows: fast was the latency optimum anyway;
    # make slow the 1-stream optimum by a hair and the tie hands the plan to fast, 8 streams' best
    slow = dataclasses.replace(slow, layer_ms=(0.995, 3.0))
    hosts = [fast, slow]
    assert [s.host for s in plan_split(hosts, 10, need, Links(), "latency", 8, 1, tie=0).stages] == ["slow"]
    assert [s.host for s in plan_split(hosts, 10, need, Links(), "latency", 8, 1).stages] == ["fast"]
    slow = dataclasses.replace(slow, layer_ms=(0.9, 3.0))     # 8% ahead at 1 stream: no tie
    assert [s.host for s in plan_split([fast, slow], 10, need, Links(), "latency", 8, 1).stages] == ["slow"]


def test_a_slow_link_keeps_the_layers_on_one_host():
    """Two equal hosts: over a fast link the planner splits (two stages), over a link that costs
    more than the layers it would move it keeps every layer on one host; an activation's bytes
    over the bandwidth count per hop, so the same round trip with a thin link is slower."""
    a, b = host("a", 1.0), host("b", 1.0)
    need = lambda x, y: y - x   # noqa: E731
    thin = Links.from_rtt(0.2, bytes_per_s={("a", "b"): 1e5})    # 100 kB/s between the two hosts
    one = plan_split([a, b], 30, need, thin, "throughput", row_bytes=2304)
    assert len(one.stages) == 1 and (one.stages[0].start, one.stages[0].end) == (0, 30)
    two = predict((Stage("a", 0, 15), Stage("b", 15, 30)), {"a": a, "b": b}, 30, thin, row_bytes=2304)
    assert two.hop_ms_1[1] == pytest.approx(0.1 + 2304 / 100)    # rtt / 2 + bytes / (bytes per ms)
    assert two.tok_s_n < one.tok_s_n
    fast = Links.from_rtt(0.2, bytes_per_s={("a", "b"): 1e9})
    split = plan_split([a, b], 30, need, fast, "throughput", row_bytes=2304)
    assert len(split.stages) == 2 and split.stages[0].end in (14, 15, 16)


def test_the_host_order_follows_the_links():
    """Three equal hosts, one pair joined by a thin link: the chain never crosses it."""
    hosts = [host(n, 1.0, memory=12) for n in ("a", "b", "c")]
    links = Links.from_rtt(0.2, bytes_per_s={("a", "c"): 1e5})
    p = plan_split(hosts, 30, lambda x, y: y - x, links, "latency", n_stages=3, row_bytes=2304)
    order = [s.host for s in p.stages]
    assert sorted(order) == ["a", "b", "c"] and order[1] == "b", order   # a and c never neighbours


def test_links_from_the_workers_measured_driver_links():
    links = Links.from_driver_links({"a": {"rtt_ms": 2.0, "bytes_per_s": 1e8}, "b": {"rtt_ms": 6.0, "bytes_per_s": 1e7},
                                     "c": {"rtt_ms": "?", "bytes_per_s": 1}}, default_rtt_ms=0.4)
    assert links.ms(DRIVER, "a") == 1.0 and links.ms("b", DRIVER, 10_000) == pytest.approx(3.0 + 1.0)
    assert links.ms("a", "b", 10_000) == pytest.approx(3.0 + 1.0)   # the slower link of the two
    assert links.ms("a", "c") == 0.2                                # c measured nothing usable: the default


def test_a_quota_burst_is_fast_when_short_and_sustained_when_long():
    assert throttled_ms(1.0, 0.25, 10.0) == pytest.approx(1.0)        # within the 2.5 ms budget
    assert throttled_ms(2.5, 0.25, 10.0) == pytest.approx(2.5)
    long = throttled_ms(50.0, 0.25, 10.0)                              # 20 periods of budget
    assert 190 - 10 <= long <= 200 and long < 50 / 0.25
    slow = HostSpeed("s", (1,), (2.0,), (1.0,), (4.0,), idle_ratio=0.25, period_ms=10.0)
    assert slow.stage_ms(1, False, burst=True) == pytest.approx(0.75)   # 3 ms measured busy, 0.75 of work
    assert slow.stage_ms(1, False) == 3.0
    assert slow.stage_ms(30, True, burst=True) < slow.stage_ms(30, True)
    assert HostSpeed("f", (1,), (2.0,), (1.0,), (4.0,)).stage_ms(1, False, burst=True) == 3.0   # no quota


def test_a_slow_host_gets_fewer_layers_and_memory_caps_bind():
    fast, slow = host("fast", 1.0), host("slow", 4.0)
    lat = plan_split([fast, slow], 30, lambda a, b: b - a, Links(0.1), "latency", n_stages=2)
    assert [s.host for s in lat.stages] == ["slow", "fast"] and lat.stages[0].end == 1   # the head on the fast host
    thr = plan_split([fast, slow], 30, lambda a, b: b - a, Links(0.1), "throughput", n_stages=2)
    layers = {s.host: s.end - s.start for s in thr.stages}
    assert layers["fast"] > 3 * layers["slow"] - 3, thr
    capped = plan_split([host("fast", 1.0, memory=20), slow], 30, lambda a, b: b - a, Links(0.1), "latency")
    assert {s.host: s.end - s.start for s in capped.stages} == {"fast": 20, "slow": 10}
    with pytest.raises(SpeedPlanError, match="fits their memory"):
        plan_split([host("a", 1.0, memory=10), host("b", 1.0, memory=10)], 30, lambda a, b: b - a)


def test_plan_hosts_cli_writes_a_topology_with_predictions(model_dir, tmp_path):
    base = {"schema": "skippy-host-speed/1", "prefill": {"chunk": 64, "layer_ms_per_token": 0.02}}
    hosts = [dict(base, name=name, decode={"1": {"layer_ms": 0.2 * k, "step_ms": 0.3, "head_ms": 1.5 * k, "message_ms": 0.02},
                                           "8": {"layer_ms": 0.5 * k, "step_ms": 0.4, "head_ms": 4 * k, "message_ms": 0.03}})
             for name, k in (("big", 1), ("mid", 2), ("small", 4))]
    hosts[2]["address"] = "10.9.0.4"
    (tmp_path / "hosts.json").write_text(json.dumps({"hosts": [{"memory": "4GiB", "measure": h} for h in hosts],
                                                     "links": {"default_rtt_ms": 0.4, "rtt_ms": {"big->mid": 2.0}}}))
    out = subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "plan", "--model", str(model_dir), "--weights", "q4",
                          "--hosts", str(tmp_path / "hosts.json"), "--objective", "throughput", "--stages", "3"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "# predicted: 1 stream" in out.stdout and "tok/s" in out.stdout
    (tmp_path / "topo.yaml").write_text(out.stdout)
    topo = load_topology(tmp_path / "topo.yaml")
    assert [s.end - s.start for s in topo.stages] and sum(s.end - s.start for s in topo.stages) == 30
    assert all(s.memory == 4 * 1024 ** 3 and s.weights == "q4" for s in topo.stages)
    data = yaml.safe_load(out.stdout)
    small = [s for s in data["stages"] if s["host"] == "10.9.0.4"]
    assert len(small) == 1 and small[0]["listen"].startswith("tcp://10.9.0.4:")
    layers = {line.split(" on ")[1].split(":")[0]: line for line in out.stdout.splitlines() if " on " in line}
    assert set(layers) == {"big", "mid", "small"}


def test_plan_hosts_cli_names_a_bad_file(model_dir, tmp_path):
    (tmp_path / "hosts.json").write_text(json.dumps({"hosts": [{"name": "x"}]}))
    out = subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "plan", "--model", str(model_dir), "--hosts",
                          str(tmp_path / "hosts.json")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 1 and "host measurement 'x' is not a measure_host result" in out.stderr


def test_host_speed_interpolates_between_the_rows_measured():
    h = HostSpeed("h", (1, 4, 8), (1.0, 4.0, 5.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))
    assert [h.at(h.layer_ms, r) for r in (1, 2, 4, 6, 8, 16)] == [1.0, 2.0, 4.0, 4.5, 5.0, 5.0]
    m = {"name": "m", "decode": {str(r): {"layer_ms": r, "step_ms": 0.5, "head_ms": 2.0, "sample_ms": 0.1,
                                          "message_ms": 0.2} for r in (8, 1, 4)}}
    got = HostSpeed.from_measure(m, memory=7)
    assert got.rows == (1, 4, 8) and got.layer_ms == (1.0, 4.0, 8.0) and got.step_ms == (0.7, 0.7, 0.7)
    assert got.head_ms == (2.1, 2.1, 2.1) and got.memory == 7
