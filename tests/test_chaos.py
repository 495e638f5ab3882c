"""Every chaos scenario once against real processes (3 stages): a stage dies mid-stream, in a
prefill chunk or while a prefix restore is in flight (first, middle and last), two die at once,
one dies twice; each is restarted and greedy output equals the fault-free run."""

from __future__ import annotations

import pytest

from procs import write_topology
from skippy_zmq import chaos

SCENARIOS = chaos.scenarios()


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos")
    topo = write_topology(tmp, model_dir, 3, name="chaos", driver__prefill_chunk=64, driver__heartbeat_s=0.25,
                          driver__dead_after_s=1.0, driver__resume_timeout_s=60.0,
                          cache={"mode": "lookup-record", "max_bytes": 64 << 20, "stride": 64, "min_tokens": 32})
    chaos_run = chaos.ChaosRun(topo, tmp / "run")
    yield chaos_run
    chaos_run.close()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_gives_the_fault_free_output(run, scenario):
    r = run.play(scenario)
    assert r.error == "" and r.identical, r
    assert r.detect_s is not None and r.detect_s <= 1.0 + 1.0   # dead_after + one heartbeat of slack
    assert not list(run.fault_dir.glob("*.json"))               # every armed fault fired


def test_the_table_counts_rounds_identical_and_errors():
    rounds = [chaos.Round("a", True, "", 1.0, 5.0), chaos.Round("a", False, "boom", 2.0, 7.0),
              chaos.Round("b", True, "", None, None)]
    rows = chaos.summarize(rounds)
    assert rows == [{"scenario": "a", "rounds": 2, "identical": 1, "errors": 1, "median_detect_s": 1.5,
                     "median_resume_s": 6.0},
                    {"scenario": "b", "rounds": 1, "identical": 1, "errors": 0, "median_detect_s": None,
                     "median_resume_s": None}]
    assert chaos.markdown(rows).splitlines()[2] == "| a | 2 | 1 | 1 | 1.5 | 6.0 |"
