"""Re-cut while serving (cluster/rebalance.py, engine/recut.py): real worker processes joined over
CURVE, a real pipeline engine, 8 greedy streams running while the split moves; every stream's
tokens equal the one-process engine's, and a model that no longer fits says what is missing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import yaml

from test_cluster import cluster_topology, driver_log, start_worker, stop, tiny_model  # noqa: F401 (fixtures)
from skippy_zmq.cluster.drift import DriftMonitor, scale_measure
from skippy_zmq.ops.lifetime import tied_env

PROMPTS = [[5 + i, 17, 33 + i, 8, 61, 40 - i, 12] for i in range(8)]


def recut_topology(tmp, model, n_stages: int, **cluster):
    # drift is off here (the test's "slow" worker only says it is slow): its own test is below
    cluster = {"split": "measured", "recut_threshold": 0, **cluster}
    path = cluster_topology(tmp, model, n_stages, **cluster)
    data = yaml.safe_load(path.read_text())
    data["driver"].update(resume_timeout_s=600, max_sessions=8)   # a loaded test machine restarts stages slowly
    for stage in data["stages"]:   # idle warm-ups on, as served: a re-cut settles once its stages compiled every
        stage.pop("idle_warmups", None)   # shape; without them a shape first met later compiles then
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def expected_tokens(model, n: int) -> list[list[int]]:
    from skippy_zmq.engine.generate import LocalEngine
    from skippy_zmq.sampling import SamplingParams

    local = LocalEngine(model)
    return [local.generate(p, SamplingParams(), n, True).token_ids for p in PROMPTS]


LONGEST = 200   # the most tokens a test here streams


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    """Each prompt's greedy tokens from the one-process engine, made once for the module's longest
    run: greedy with ignore_eos, a step does not depend on max_tokens, so a run of n tokens is the
    first n of a longer one and a shorter test compares with a prefix (was one engine and run each)."""
    return expected_tokens(tiny_model, LONGEST)


def prefix(reference: list[list[int]], n: int) -> list[list[int]]:
    assert n <= LONGEST
    return [ids[:n] for ids in reference]


class Streams:
    """8 greedy streams on threads; `started` once each has `warm` tokens."""

    def __init__(self, engine, n: int, warm: int = 3):
        from skippy_zmq.engine.request import GenRequest

        self.tokens: list[list[int]] = [[] for _ in PROMPTS]
        self.errors: list[str] = []
        self.warm = threading.Barrier(len(PROMPTS) + 1)
        self.threads = [threading.Thread(target=self.run, args=(engine, GenRequest(f"r{i}", tuple(p), max_tokens=n,
                                                                                     ignore_eos=True), i, warm))
                        for i, p in enumerate(PROMPTS)]
        for t in self.threads:
            t.start()

    def run(self, engine, req, i: int, warm: int) -> None:
        waited = False
        try:
            for event in engine.generate_blocking(req):
                if event.token_id is not None:
                    self.tokens[i].append(event.token_id)
                if not waited and len(self.tokens[i]) >= warm:
                    waited = True
                    self.warm.wait(120)
        except Exception as exc:   # the test asserts there are none
            self.errors.append(f"r{i}: {exc}")
        finally:
            if not waited:
                self.warm.abort()

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a stream did not finish"


def start_cluster(tmp_path, topology, workers: dict[str, list[str]], env: dict | None = None):
    from skippy_zmq.cluster.server import ClusterServer

    server = ClusterServer(topology)
    procs = {name: start_worker(server.token.text(), tmp_path / name, tmp_path / f"{name}.log", "--name", name,
                                "--no-devices", *extra, env=(env or {}).get(name))
             for name, extra in workers.items()}
    return server, procs


def serve(server, procs, tmp_path, n_workers: int):
    """Every stage placed, the engine ready, the rebalancer attached. The workers' measurements are
    given (the same for each): the re-cut's subject is not measuring (tests/test_cluster.py's is)."""
    from skippy_zmq.api.main import open_engine
    from skippy_zmq.engine.recut import attach_rebalancer

    def settled() -> bool:   # every stage placed and started, or a worker died
        return any(p.poll() is not None for p in procs.values()) or (
            server.placed is not None and sum(1 for w in server.workers.values() if w.started) == n_workers)
    server.wait_until(settled, 400)
    assert server.placed is not None and all(p.poll() is None for p in procs.values()), \
        [(tmp_path / f"{n}.log").read_text()[-2000:] for n in procs]
    for w in server.workers.values():
        w.measured = fake_measure(8 << 30)
    placed = server.placed
    engine, _ = open_engine(placed)
    wait_alive(engine, procs, tmp_path)
    return engine, attach_rebalancer(server, engine)


def wait_alive(engine, procs, tmp_path, timeout: float = 400) -> None:
    """The pipeline is ready within `timeout` s, and no worker died meanwhile."""
    deadline = time.monotonic() + timeout
    while not engine.wait_ready(0.5):
        dead = [n for n, p in procs.items() if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, (engine.not_ready_reason(), dead, [
            (tmp_path / f"{n}.log").read_text()[-2000:] for n in procs])


def split_of(server) -> dict[str, tuple[int, int]]:
    return {w.name: (server.topology.stage(w.stage).start, server.topology.stage(w.stage).end)
            for w in server.workers.values() if w.stage is not None}


def close_all(server, procs, *closers) -> None:
    """The rebalancer and engine (either may be None: a start that failed), the workers, the server."""
    for closer in closers:
        if closer is not None:
            closer.close()
    for proc in procs.values():
        stop(proc)
    server.close()


@pytest.mark.slow
def test_a_rebalance_on_command_while_8_streams_run_fails_none_and_changes_no_token(tiny_model, reference,
                                                                                      tmp_path, driver_log):
    """`skippy-zmq rebalance` while 8 streams decode: the worker of s1 got slow (its measurement
    scaled as drift would), the split moves its layers to the other, no stream fails, every token equal."""
    from skippy_zmq.config.topology_yaml import load_topology

    n = 200
    expected = prefix(reference, n)
    topology = load_topology(recut_topology(tmp_path, tiny_model, 2, split="topology"))
    server, procs = start_cluster(tmp_path, topology, {"a": ["--no-measure"], "b": ["--no-measure"]})
    engine = rebalancer = None
    try:
        engine, rebalancer = serve(server, procs, tmp_path, 2)
        slowed = holder(server, "s1")
        before = split_of(server)
        assert before[slowed] == (2, 4)
        rebalancer.drift.scale[slowed] = 10.0       # fresh numbers: it is now 10x slower than it measured
        running, begin = [], rebalancer.target.begin

        def begin_mid_run(reason: str, kept=()) -> None:   # the pause comes with all 8 streams mid-run, whatever
            running.append(Streams(engine, n))      # the CLI's start-up took (a loaded machine's seconds)
            running[0].warm.wait(300)
            begin(reason, kept)
        rebalancer.target.begin = begin_mid_run
        cli = subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "rebalance", "--join", server.token.text(),
                              "--timeout", "600"], capture_output=True, text=True, timeout=700, env=tied_env())
        streams = running[0]
        streams.join(600)
        assert cli.returncode == 0, cli.stderr[-3000:]
        outcome = yaml.safe_load(cli.stdout)
        assert outcome["ok"] and outcome["changed"], outcome
        after = split_of(server)
        assert after[slowed][1] - after[slowed][0] == 1 and after != before
        assert streams.errors == []
        assert streams.tokens == expected
        assert any("re-cut (asked for" in line and "paused 8 request(s)" in line for line in driver_log), \
            [line for line in driver_log if "re-cut" in line]
        assert all(w.next_files is None for w in server.workers.values())
        assert prepared_starts(tmp_path, procs) == ["s0", "s1"]   # built while the old split served
        # its cost was measured: begin until every stage of the new split was ready and done compiling
        assert 0 < outcome["cost_s"] == rebalancer.cost_s < topology.driver.resume_timeout_s
        assert rebalancer.target.settle(1.0) and not any(s.info["compiling"] for s in engine.stages.values())
        assert_damped(server, rebalancer, slowed, after)
    finally:
        close_all(server, procs, rebalancer, engine)


def assert_damped(server, rebalancer, slowed: str, split: dict) -> None:
    """A drift re-cut that would not pay back the last one's cost (made huge here) is skipped: the
    split, the stages' processes and the history stay as they are, and the skip says why."""
    pids = {w.name: w.started["pid"] for w in server.workers.values()}
    rebalancer.drift.scale[slowed] = 0.1        # now 10x faster than it measured: a new plan moves layers
    rebalancer.cost_s = 1e6
    outcome = rebalancer.recut("drift (a test)", damped=True)
    assert outcome["ok"] and not outcome["changed"] and "the last re-cut cost 1000000.0 s" in outcome["skipped"]
    assert split_of(server) == split and {w.name: w.started["pid"] for w in server.workers.values()} == pids
    assert len(rebalancer.history) == 1 and rebalancer.skipped[0]["reason"] == "drift (a test)"


def prepared_starts(tmp_path, procs) -> list[str]:
    """The stages the workers started from a held process, built before the switch (cluster/next_stage.py)."""
    lines = [line for n in procs for line in (tmp_path / f"{n}.log").read_text().splitlines()
             if "was prepared; it opens its ports" in line]
    return sorted(line.split(": stage ")[1].split()[0] for line in lines)


def fake_measure(memory: int) -> dict:
    """A measure_host-shaped result (the same for every worker), with `memory` available."""
    decode = {str(r): {"layer_ms": 1.0 + r / 8, "step_ms": 0.2, "head_ms": 0.5, "sample_ms": 0.01,
                       "message_ms": 0.05} for r in (1, 4, 8)}
    return {"name": "fake", "decode": decode, "prefill": {"chunk": 64, "layer_ms_per_token": 0.02},
            "memory_available": memory}


def stage_needs(topology) -> dict[tuple[int, int], int]:
    from skippy_zmq.cluster.split import stage_settings
    from skippy_zmq.config.model import ModelConfig
    from skippy_zmq.ops import placement

    cfg, settings = ModelConfig.load(topology.model_path / "model.json"), stage_settings(topology)
    return {(a, b): placement.stage_need(cfg, a, b, settings).total for a in range(4) for b in range(a + 1, 5)}


def holder(server, stage_id: str) -> str:
    return next(w.name for w in server.workers.values() if w.stage == stage_id)


@pytest.mark.slow
def test_a_worker_gone_for_good_is_planned_around_or_named_in_a_503(tiny_model, reference, tmp_path,
                                                                     driver_log):
    """8 streams; the worker of s1 is killed: the one left holds every layer, the streams resume with
    every token equal. It rejoins (a joiner: the split is cut in two again). Then, with memory for
    only half the model each, one is killed again: requests get a 503 naming the missing layers."""
    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.engine.request import EngineError, GenRequest

    n = 150
    expected = prefix(reference, n)
    topology = load_topology(recut_topology(tmp_path, tiny_model, 2, split="topology",
                                             gone_after_s=10))   # 10 missed beats: a loaded machine starves a worker for seconds
    needs = stage_needs(topology)
    half = max(needs[(0, 2)], needs[(2, 4)])
    assert half < needs[(0, 4)]
    server, procs = start_cluster(tmp_path, topology, {"a": ["--no-measure"], "b": ["--no-measure"]})
    engine = rebalancer = None
    try:
        engine, rebalancer = serve(server, procs, tmp_path, 2)
        streams = Streams(engine, n)
        streams.warm.wait(300)
        gone = holder(server, "s1")
        procs[gone].kill()                           # for good: SIGKILL, its stage dies with it
        streams.join(600)
        assert streams.errors == [] and streams.tokens == expected
        left = "b" if gone == "a" else "a"
        assert split_of(server) == {left: (0, 4)} and len(engine.stages) == 1
        assert any(f"worker {gone} (stage s1, layers [2, 4)) is gone" in line for line in driver_log)

        procs[gone] = start_worker(server.token.text(), tmp_path / gone, tmp_path / f"{gone}.log", "--name", gone,
                                   "--no-devices", "--no-measure")
        assert server.wait_until(lambda: len(rebalancer.history) == 2, 300), rebalancer.history
        wait_alive(engine, procs, tmp_path)
        assert sorted(split_of(server)) == ["a", "b"] and len(engine.stages) == 2

        for w in server.workers.values():
            w.measured["memory_available"] = half   # now only two of them hold the model
        gone = holder(server, "s1")
        stage = server.topology.stage("s1")
        procs[gone].kill()
        assert server.wait_until(lambda: engine.missing is not None, 120)
        with pytest.raises(EngineError) as err:
            list(engine.generate_blocking(GenRequest("late", tuple(PROMPTS[0]), max_tokens=4)))
        assert err.value.status == 503 and err.value.code == "layers_missing"
        assert f"layers [{stage.start}, {stage.end}) (worker {gone}, gone) missing" in err.value.message
    finally:
        close_all(server, procs, rebalancer, engine)


def test_drift_over_the_threshold_for_the_window_asks_for_a_recut_with_scaled_numbers(tiny_model, tmp_path):
    from types import SimpleNamespace

    from skippy_zmq.config.topology_yaml import load_topology

    topology = load_topology(recut_topology(tmp_path, tiny_model, 2))
    workers = {n: SimpleNamespace(name=n, stage=s, measured=fake_measure(1 << 30), started=None)
               for n, s in (("a", "s0"), ("b", "s1"))}
    drift = DriftMonitor(1.3, 10.0)
    drift.reset(topology, workers)
    planned = 2 * (1.0 + 1 / 8)                      # 2 layers at 1 row (s1 adds head + sampling: 0.51)
    for _ in range(40):                              # b's stage takes 2x its plan, a's as planned
        drift.observe([{"stage": "s0", "compute_ms": planned, "rows": 1},
                       {"stage": "s1", "compute_ms": 2 * (planned + 0.51), "rows": 1}, "junk",
                       {"stage": ["s0"]}, {"stage": "s0", "rows": "many"}, {"stage": "s1", "compute_ms": {}}])
    assert drift.check(100.0) is None                # over the threshold, but not for the window yet
    reason = drift.check(111.0)
    assert reason is not None and "stage s1 on worker b runs 2.00x slower" in reason
    assert drift.scale == {"a": pytest.approx(1.0), "b": pytest.approx(2.0)}
    assert drift.scaled("b", fake_measure(1))["decode"]["1"]["layer_ms"] == pytest.approx(2 * (1.0 + 1 / 8))
    assert scale_measure(fake_measure(1), 3.0)["prefill"]["layer_ms_per_token"] == pytest.approx(0.06)
    off = DriftMonitor(0, 10.0)                      # threshold 0: never
    off.reset(topology, workers)
    off.observe([{"stage": "s1", "compute_ms": 99.0, "rows": 1}] * 40)
    assert off.check(0.0) is None and off.check(1e6) is None


def test_drift_counts_only_decode_steps_of_stages_done_compiling_and_any_recut_takes_fresh_numbers(tiny_model,
                                                                                                  tmp_path):
    from types import SimpleNamespace

    from skippy_zmq.config.topology_yaml import load_topology

    topology = load_topology(recut_topology(tmp_path, tiny_model, 2))
    workers = {n: SimpleNamespace(name=n, stage=s, measured=fake_measure(1 << 30), started=None)
               for n, s in (("a", "s0"), ("b", "s1"))}
    drift = DriftMonitor(1.3, 10.0)
    drift.reset(topology, workers)
    planned = 2 * (1.0 + 1 / 8)
    for _ in range(40):   # a prefill chunk (32 positions) and a stage still compiling: neither counts
        drift.observe([{"stage": "s0", "compute_ms": 50 * planned, "rows": 1, "tokens": 32},
                       {"stage": "s1", "compute_ms": 50 * planned, "rows": 1, "tokens": 1}], warming=["s1"])
    assert drift.samples == {} and drift.refresh() == {}
    for _ in range(40):   # decode steps: b takes 3x its plan (the head and sampling too)
        drift.observe([{"stage": "s0", "compute_ms": planned, "rows": 1, "tokens": 1},
                       {"stage": "s1", "compute_ms": 3 * (planned + 0.51), "rows": 1, "tokens": 1}])
    assert drift.refresh() == {"a": pytest.approx(1.0), "b": pytest.approx(3.0)}   # e.g. `rebalance` asked
    assert drift.refresh() == {"a": pytest.approx(1.0), "b": pytest.approx(3.0)}   # taken once, not twice
    for _ in range(40):   # the split stayed: b still 3x what it measured, now planned so: no drift
        drift.observe([{"stage": "s0", "compute_ms": planned, "rows": 1, "tokens": 1},
                       {"stage": "s1", "compute_ms": 3 * (planned + 0.51), "rows": 1, "tokens": 1}])
    assert drift.check(0.0) is None and drift.check(100.0) is None
    assert drift.ratio["s1"] / drift.ratio["s0"] == pytest.approx(1.0)


def test_the_one_process_reference_for_many_streams_decodes_them_together_token_for_token(tiny_model, reference):
    """LocalEngine.generate_many (bench cluster's re-cut row checks 8 streams against it): each
    prompt's tokens are what one prompt at a time gives (the module's reference, made so)."""
    from skippy_zmq.engine.generate import LocalEngine

    together = LocalEngine(tiny_model, lanes=8).generate_many(PROMPTS, 40, ignore_eos=True)
    assert together == prefix(reference, 40)
    with pytest.raises(ValueError, match="9 prompts for an engine of 8 lane"):
        LocalEngine(tiny_model, lanes=8).generate_many(PROMPTS + PROMPTS[:1], 4)


@pytest.mark.parametrize("key, value, says", [("recut_threshold", 1.0, "a factor above 1"),
                                               ("recut", "yes", "true or false"),
                                               ("gone_after_s", -1, "gone_after_s")])
def test_a_bad_recut_setting_is_named(tiny_model, tmp_path, key, value, says):
    from skippy_zmq.config.topology import TopologyError
    from skippy_zmq.config.topology_yaml import load_topology

    path = recut_topology(tmp_path, tiny_model, 2)
    assert load_topology(path).cluster.recut is True
    data = yaml.safe_load(path.read_text())
    data["cluster"][key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(TopologyError) as err:
        load_topology(path)
    assert f"cluster.{key}" in str(err.value) and says in str(err.value)


@pytest.mark.slow
def test_a_recut_leaves_a_stage_whose_layers_and_next_hop_stay_running(tiny_model, reference, tmp_path, driver_log):
    """3 stages; a re-cut swaps the workers of s1 and s2 while 8 streams decode: s0 (same worker,
    layers and next hop) is neither halted nor restarted (same pid and incarnation, no READY again;
    its KV and compiled steps stay), the other two are; no stream fails, every token equal."""
    from skippy_zmq.cluster.split import MeasuredSplit, host_speed
    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.ops.speed import Links, Stage, predict

    n = 120
    expected = prefix(reference, n)
    topology = load_topology(recut_topology(tmp_path, tiny_model, 3, split="topology"))
    server, procs = start_cluster(tmp_path, topology, {"a": ["--no-measure"], "b": ["--no-measure"],
                                                       "c": ["--no-measure"]})
    engine = rebalancer = None
    try:
        engine, rebalancer = serve(server, procs, tmp_path, 3)
        order = tuple(holder(server, s.id) for s in server.topology.stages)
        pids = {w.name: w.started["pid"] for w in server.workers.values()}
        first = engine.stages["s0"].incarnation
        swapped = (order[0], order[2], order[1])
        hosts = {name: host_speed(name, fake_measure(8 << 30)) for name in swapped}
        prediction = predict([Stage(w, s.start, s.end) for w, s in zip(swapped, server.topology.stages)], hosts,
                             server.topology.stages[-1].end, Links())
        streams = Streams(engine, n)
        streams.warm.wait(300)
        outcome = rebalancer.switch(MeasuredSplit(server.topology, swapped, prediction), "a test's split")
        streams.join(600)
        assert outcome["ok"] and outcome["kept"] == ["s0"], outcome
        assert tuple(holder(server, s.id) for s in server.topology.stages) == swapped
        now = {w.name: w.started["pid"] for w in server.workers.values()}
        assert now[order[0]] == pids[order[0]] and engine.stages["s0"].incarnation == first
        assert now[order[1]] != pids[order[1]] and now[order[2]] != pids[order[2]]
        assert streams.errors == [] and streams.tokens == expected
        assert prepared_starts(tmp_path, procs) == ["s1", "s2"]
        readies = [line for line in driver_log if "is ready (incarnation" in line]
        assert not any("stage s0 is ready" in line for line in readies[-2:]), readies
        assert sorted(line.split("stage ")[1][:2] for line in readies[-2:]) == ["s1", "s2"], readies
    finally:
        close_all(server, procs, rebalancer, engine)
