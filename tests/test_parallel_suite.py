"""What lets the suite run on parallel workers: each worker picks ports from its own slice, the
llama.cpp sdist is fetched once however many ask at once, and the shared pipelines' users are one unit."""

from __future__ import annotations

import re
import threading
import time

import pytest

from conftest import LONGEST_FIRST, SHARED_MODULES, SHARED_UNIT, work_unit, worker_port_slice
from skippy_zmq.devtools import llama_cpp_models
from skippy_zmq.devtools import harness


def test_port_slices_are_disjoint_and_cover_the_range(monkeypatch):
    slices = []
    for i in range(3):
        monkeypatch.setenv(harness.PORT_SLICE_ENV, f"{i}/3")
        slices.append(harness.port_slice(20_000, 32_000))
    assert slices == [(20_000, 24_000), (24_000, 28_000), (28_000, 32_000)]
    monkeypatch.delenv(harness.PORT_SLICE_ENV)
    assert harness.port_slice(20_000, 32_000) == (20_000, 32_000)


def test_a_worker_picks_free_ports_inside_its_slice(monkeypatch):
    monkeypatch.setenv(harness.PORT_SLICE_ENV, "1/2")
    low = harness._ephemeral_range()[0]
    lo, hi = harness.port_slice(max(1024, low - 12_000), low)
    assert all(lo <= harness.free_base_port(4) and harness.free_base_port(4) + 4 <= hi for _ in range(20))


def test_a_worker_slice_nests_inside_the_slice_the_run_was_given(monkeypatch):
    assert [worker_port_slice("", w, 2) for w in (0, 1)] == ["0/2", "1/2"]
    assert [worker_port_slice("2/8", w, 2) for w in (0, 1)] == ["4/16", "5/16"]
    outer = (20_000, 32_000)
    monkeypatch.setenv(harness.PORT_SLICE_ENV, "2/8")
    lo, hi = harness.port_slice(*outer)
    for w in (0, 1):
        monkeypatch.setenv(harness.PORT_SLICE_ENV, worker_port_slice("2/8", w, 2))
        w_lo, w_hi = harness.port_slice(*outer)
        assert lo <= w_lo < w_hi <= hi


@pytest.mark.parametrize("spec, message", [("1", "expected 'i/n'"), ("a/b", "expected 'i/n'"),
                                           ("2/2", "i must be in [0, n)"), ("-1/2", "i must be in [0, n)")])
def test_a_bad_port_slice_is_refused_by_name(monkeypatch, spec, message):
    monkeypatch.setenv(harness.PORT_SLICE_ENV, spec)
    with pytest.raises(RuntimeError, match=f"SKIPPY_PORT_SLICE={re.escape(repr(spec))}: {re.escape(message)}"):
        harness.port_slice(20_000, 32_000)


def test_concurrent_fetches_of_the_sdist_extract_it_once(monkeypatch, tmp_path):
    calls = []

    def slow_extract(target, package, version):
        calls.append(threading.get_ident())
        time.sleep(0.3)                          # the other caller arrives while this one works
        (target / "templates").mkdir(parents=True)
        (target / ".complete").write_text("x")
        return target

    monkeypatch.setattr(llama_cpp_models, "_extract_llama_cpp_models", slow_extract)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(llama_cpp_models.fetch_llama_cpp_models(tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1 and len(got) == 3 and len(set(got)) == 1 and (got[0] / ".complete").is_file()


def test_the_shared_pipelines_users_are_one_unit_and_every_other_module_its_own():
    assert {work_unit(f"tests/{m}.py::test_x[a::b]") for m in SHARED_MODULES} == {SHARED_UNIT}
    assert work_unit("tests/test_chaos.py::test_scenario[prefill-chunk/first]") == "test_chaos"
    assert LONGEST_FIRST[0] == SHARED_UNIT and len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_a_free_endpoint_beside_a_topology_takes_none_of_its_ports(monkeypatch, tmp_path):
    import procs

    topology = tmp_path / "t.yaml"
    topology.write_text("driver:\n  http: 127.0.0.1:24918\n  return: tcp://127.0.0.1:24917\n")
    offered = iter([24918, 24917, 24999])
    monkeypatch.setattr(procs, "free_base_port", lambda count: next(offered))
    assert procs.free_endpoint(beside=topology) == "tcp://127.0.0.1:24999"


def test_a_worker_that_replaces_a_crashed_one_gets_work_once_its_collection_is_in(monkeypatch):
    from types import SimpleNamespace

    import conftest
    from xdist.scheduler import loadscope

    monkeypatch.setattr(loadscope, "parse_tx_spec_config", lambda config: ["popen", "popen"])
    sched = conftest.pytest_xdist_make_scheduler(SimpleNamespace(), None)
    sent = []

    class Worker:   # the part of xdist's WorkerController the scheduler uses here (hashable, as it is)
        shutting_down = False
        send_runtest_some = staticmethod(sent.append)

    node = Worker()
    sched.workqueue["tests/test_a.py"] = {"tests/test_a.py::t": False}
    sched.assigned_work[node] = {}
    sched._assign_work_unit(node)                  # no collection from it yet: nothing taken, nothing sent
    assert list(sched.workqueue) == ["tests/test_a.py"] and sent == []
    sched.registered_collections[node] = ["tests/test_a.py::t"]
    sched._assign_work_unit(node)
    assert not sched.workqueue and sent == [[0]]
