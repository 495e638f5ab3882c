"""Every chaos scenario once against real processes (3 stages): a stage dies mid-stream, in a
prefill chunk or while a prefix restore is in flight (first, middle and last), two die at once,
one dies twice, one dies on a DECODE carrying a speculative verify window (first, middle and last);
each is restarted and greedy output equals the fault-free run (for the speculating "copy" prompt, the
fault-free run equals the speculation-off run too)."""

from __future__ import annotations

import pytest

from procs import write_topology
from skippy_zmq import chaos

SCENARIOS = chaos.scenarios()
PARAMS = [pytest.param(s, id=s.name, marks=[pytest.mark.slow] if s.prompt in chaos.SPECULATING else [])
          for s in SCENARIOS]


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos")
    topo = write_topology(tmp, model_dir, 3, name="chaos", driver__prefill_chunk=64, driver__heartbeat_s=0.25,
                          driver__dead_after_s=1.0, driver__resume_timeout_s=60.0,
                          cache={"mode": "lookup-record", "max_bytes": 64 << 20, "stride": 64, "min_tokens": 32})
    chaos_run = chaos.ChaosRun(topo, tmp / "run")
    yield chaos_run
    chaos_run.close()


@pytest.mark.parametrize("scenario", PARAMS)
def test_scenario_gives_the_fault_free_output(run, scenario):
    r = run.play(scenario)
    assert r.error == "" and r.identical, r
    assert r.detect_s is not None and r.detect_s <= 1.0 + 1.0   # dead_after + one heartbeat of slack
    assert not list(run.fault_dir.glob("*.json"))               # every armed fault fired
    if scenario.prompt in chaos.SPECULATING:   # the stage died on a window, and windows ran around it
        assert run.topology.driver.speculative.enabled and run.clean_windows[scenario.prompt] > 0
        assert r.windows is not None and r.windows > 0
    else:
        assert r.windows is None


def test_the_table_counts_rounds_identical_and_errors():
    rounds = [chaos.Round("a", True, "", 1.0, 5.0), chaos.Round("a", False, "boom", 2.0, 7.0),
              chaos.Round("b", True, "", None, None, windows=3), chaos.Round("b", True, "", None, None, windows=5)]
    rows = chaos.summarize(rounds)
    assert rows == [{"scenario": "a", "rounds": 2, "identical": 1, "errors": 1, "median_detect_s": 1.5,
                     "median_resume_s": 6.0, "median_windows": None},
                    {"scenario": "b", "rounds": 2, "identical": 2, "errors": 0, "median_detect_s": None,
                     "median_resume_s": None, "median_windows": 4.0}]
    assert chaos.markdown(rows).splitlines()[2] == "| a | 2 | 1 | 1 | 1.5 | 6.0 |"


def test_a_window_fault_counts_only_decodes_that_carry_a_window(tmp_path, monkeypatch):
    import numpy as np

    from skippy_zmq.stage import faults
    from skippy_zmq.wire import Kind, Message

    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append(sig))
    injector = faults.FaultInjector(tmp_path / "s1.json")
    faults.arm(tmp_path, "s1", Kind.DECODE, 2, window=True)
    plain = Message(Kind.DECODE, 1, 7, tokens=np.array([5], np.int32))
    window = Message(Kind.DECODE, 2, 7, tokens=np.array([5, 6, 7], np.int32))
    rows = Message(Kind.DECODE, 3, 7, tokens=np.array([5, 6, 7], np.int32), sessions=np.array([7, 8], np.uint64),
                   extras={"lengths": [1, 2]})
    for msg in (plain, window, plain):
        injector.on_message(msg.kind, msg)
    assert not killed and injector.seen == 1
    injector.on_message(rows.kind, rows)   # a window beside a plain row counts too
    assert killed and not (tmp_path / "s1.json").exists()
