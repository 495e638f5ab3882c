"""Chaos scenarios against real processes (3 stages): a stage dies mid-stream, in a prefill chunk,
while a prefix restore is in flight, on a DECODE carrying a speculative verify window (each on one
stage here, the stages rotating; the tool plays first, middle and last), two die at once, one dies twice;
each is restarted and greedy output equals the fault-free run (for the speculating "copy" prompt, the
fault-free run equals the speculation-off run too). Each newer request kind (a json_schema-constrained
chat, a forced tool call, n = 3 seeded choices, logprobs with echo) is played once here, killing a
different stage each (slow); `skippy-zmq chaos --only json-schema,tool-call,n3,logprobs` plays every
stage of every kind."""

from __future__ import annotations

import pytest

from procs import write_topology
from skippy_zmq.devtools import chaos

# The suite plays each fault once, each on one stage, the stages rotating (a fault on every stage x
# kind is the tool's job: `skippy-zmq chaos`, scripts/chaos.sh); about 30 s a scenario on 2 cores.
PICKS = {"mid-stream/middle", "prefill-chunk/first", "restore/last", "spec-window/middle",
         "two-at-once/first+last", "same-twice/middle",
         "json-schema/first", "tool-call/middle", "n3/last", "logprobs/first"}
SCENARIOS = [s for s in chaos.scenarios() if s.name in PICKS]


def marks(s: chaos.Scenario) -> list:
    slow = [pytest.mark.slow] if s.prompt in chaos.SPECULATING or s.kind != "plain" else []
    return slow


DEAD_AFTER_S = 2.0   # 8 heartbeats: a busy machine delays one by ~0.4 s at most (lifetime.settle_heap)
RESTART_S = 600.0    # bound on a hang while a killed stage restarts (load and compile on a busy machine)
PARAMS = [pytest.param(s, id=s.name, marks=marks(s)) for s in SCENARIOS]


@pytest.fixture(scope="module")
def run(small_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos")
    topo = write_topology(tmp, small_model_dir, 3, name="chaos", driver__prefill_chunk=64, driver__heartbeat_s=0.25,
                          driver__dead_after_s=DEAD_AFTER_S, driver__resume_timeout_s=RESTART_S,
                          driver__request_timeout_s=chaos.REQUEST_TIMEOUT_S,
                          cache={"mode": "lookup-record", "max_bytes": 64 << 20, "stride": 64, "min_tokens": 32})
    chaos_run = chaos.ChaosRun(topo, tmp / "run")
    yield chaos_run
    chaos_run.close()


@pytest.mark.parametrize("scenario", PARAMS)
def test_scenario_gives_the_fault_free_output(run, scenario):
    r = run.play(scenario)
    assert r.error == "" and r.identical, r
    assert r.detect_s is not None and r.detect_s <= DEAD_AFTER_S + 1.0   # dead_after + the driver loop's slack
    assert not list(run.fault_dir.glob("*.json"))               # every armed fault fired
    if scenario.prompt in chaos.SPECULATING:   # the stage died on a window, and windows ran around it
        assert run.topology.driver.speculative.enabled and run.clean_windows[scenario.prompt] > 0
        assert r.windows is not None and r.windows > 0
    else:
        assert r.windows is None


def test_every_newer_kind_is_played_on_every_stage_by_the_tool_and_once_here():
    kinds = {s.kind for s in chaos.scenarios()} - {"plain"}
    assert kinds == set(chaos.KINDS) - {"plain"} == {"json-schema", "tool-call", "n3", "logprobs"}
    for prefix, kind, *_ in chaos.SURFACES:
        mine = [s for s in chaos.scenarios() if s.name.split("/")[0] == prefix]
        assert {s.kind for s in mine} == {kind}
        assert sorted(f.stage for s in mine for f in s.faults) == ["first", "last", "middle"]
        assert all(f.kind is not None and not f.at_token for s in mine for f in s.faults)   # answered whole
    assert sorted(s.kind for s in SCENARIOS if s.kind != "plain") == sorted(kinds)


def test_the_suite_plays_every_fault_but_the_fork_kill_once_on_every_stage_position():
    assert len(SCENARIOS) == len(PICKS)   # every pick names a scenario
    faults = {s.name.split("/")[0] for s in chaos.scenarios()}
    assert {s.name.split("/")[0] for s in SCENARIOS} == faults - {"n3-fork"}   # the tool plays n3-fork
    assert {f.stage for s in SCENARIOS for f in s.faults} == {"first", "middle", "last"}


def test_an_outcome_differs_on_text_choices_calls_and_logprobs_beyond_the_tolerance():
    from skippy_zmq.devtools.chaos_requests import LOGPROB_TOL, Outcome

    clean = Outcome(text="{}", choices=("a", "b"), calls=(("f", {"x": 1}),),
                    logprobs=(("A", None, None), ("B", -0.5, {"B": -0.5, "C": -1.25})))
    assert clean.differs(clean) == ""
    near = Outcome(text="{}", choices=("a", "b"), calls=(("f", {"x": 1}),),
                   logprobs=(("A", None, None), ("B", -0.5 + LOGPROB_TOL / 2, {"B": -0.5, "C": -1.25})))
    assert near.differs(clean) == ""
    assert Outcome(text="{ }", choices=clean.choices, calls=clean.calls, logprobs=clean.logprobs).differs(clean)
    assert Outcome(text="{}", choices=("a", "c"), calls=clean.calls, logprobs=clean.logprobs).differs(clean)
    assert Outcome(text="{}", choices=clean.choices, calls=(("f", {"x": 2}),),
                   logprobs=clean.logprobs).differs(clean).startswith("calls")
    far = (("A", None, None), ("B", -0.5, {"B": -0.5, "C": -1.25 + 2 * LOGPROB_TOL}))
    assert "token 1" in Outcome(text="{}", choices=clean.choices, calls=clean.calls, logprobs=far).differs(clean)
    other = (("A", None, None), ("D", -0.5, {"D": -0.5, "C": -1.25}))
    assert "tokens" in Outcome(text="{}", choices=clean.choices, calls=clean.calls,
                               logprobs=other).differs(clean)


def test_the_kinds_read_a_chat_tool_call_and_n_choices_with_logprobs():
    from skippy_zmq.devtools.chaos_requests import KINDS

    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}],
        "usage": {"completion_tokens": 9}}
    out = KINDS["tool-call"].read(chat)
    assert (out.text, out.calls, out.tokens) == ("", (("get_weather", {"city": "Paris"}),), 9)
    assert KINDS["tool-call"].sane(out) == ""
    lp = {"tokens": ["Hi", " there"], "token_logprobs": [None, -0.25], "top_logprobs": [None, {" there": -0.25}],
          "text_offset": [0, 2]}
    text = {"choices": [{"index": 1, "text": "b", "logprobs": None}, {"index": 0, "text": "a", "logprobs": lp},
                        {"index": 2, "text": "c", "logprobs": None}], "usage": {"completion_tokens": 3}}
    out = KINDS["n3"].read(text)
    assert out.choices == ("a", "b", "c") and out.text == "a" and KINDS["n3"].sane(out) == ""
    assert out.logprobs == (("Hi", None, None), (" there", -0.25, {" there": -0.25}))
    assert KINDS["json-schema"].sane(chaos.Outcome(text='{"name": "Mars", "moons": 2, "ringed": false}')) == ""
    assert KINDS["json-schema"].sane(chaos.Outcome(text='{"name": "Mars"}'))


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
    from skippy_zmq.protocol.wire import Kind, Message

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
