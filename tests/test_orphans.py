"""Nothing outlives its parent: stages (and a driver) spawned by a local process exit when that
process is SIGKILLed, whichever command spawned them (skippy_zmq/ops/lifetime.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from procs import write_topology
from skippy_zmq.devtools.bench.hops import DELAY_ENV
from skippy_zmq.ops.lifetime import tied_env

READY_TIMEOUT_S = 300.0   # stages load and compile the real model on a shared machine
GONE_WITHIN_S = 5.0       # the goal

HARNESS_PARENT = """
import sys
from pathlib import Path
from skippy_zmq.devtools.harness import running_pipeline
from skippy_zmq.ops.lifetime import watch_parent
watch_parent("harness")   # tied to the test: if pytest dies, this parent goes, and so do its stages
with running_pipeline(Path(sys.argv[1]), Path(sys.argv[2])):
    sys.stdin.read()   # held until killed
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def stage_pids(run_dir: Path, stage_ids: list[str], parent: subprocess.Popen) -> dict[str, int]:
    """The spawned stages' pids once every one logged READY (bounded by READY_TIMEOUT_S)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert parent.poll() is None, f"the parent exited with {parent.returncode} before its stages were ready"
        logs = {s: run_dir / f"{s}.log" for s in stage_ids}
        if all(p.is_file() and "READY" in p.read_text(errors="replace") for p in logs.values()):
            return {s: int((run_dir / f"{s}.pid").read_text()) for s in stage_ids}
        time.sleep(0.5)   # polling log files for a line: no synchronisation between our processes
    raise TimeoutError(f"stages {stage_ids} not READY within {READY_TIMEOUT_S:g} s; logs in {run_dir}")


def kill_and_wait_gone(parent: subprocess.Popen, pids: dict[str, int]) -> float:
    """SIGKILL the parent; seconds until none of `pids` runs (fails past GONE_WITHIN_S)."""
    t0 = time.monotonic()
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = t0 + GONE_WITHIN_S
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids.values()):
            return time.monotonic() - t0
        time.sleep(0.05)   # polling /proc for exits of processes that are not our children
    left = {s: pid for s, pid in pids.items() if alive(pid)}
    for pid in left.values():   # don't leave them behind for the next test
        os.kill(pid, signal.SIGKILL)
    pytest.fail(f"{sorted(left)} still running {GONE_WITHIN_S:g} s after the parent was SIGKILLed")


def parent_command(kind: str, topology: Path, run_dir: Path) -> list[str]:
    cli = [sys.executable, "-m", "skippy_zmq.cli"]
    if kind == "generate --spawn":
        return [*cli, "generate", "--topology", str(topology), "--spawn", "--run-dir", str(run_dir),
                "--raw", "--ignore-eos", "--max-tokens", "200", "--ready-timeout", str(READY_TIMEOUT_S),
                "Count slowly:"]
    if kind == "up":
        return [*cli, "up", str(topology), "--run-dir", str(run_dir)]
    return [sys.executable, "-c", HARNESS_PARENT, str(topology), str(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["generate --spawn", "up", "harness"])
def test_spawned_stages_exit_when_their_parent_is_sigkilled(small_model_dir, tmp_path, kind):
    # `generate` must still be decoding when it is killed: its 200 tokens with every hop delayed 50 ms
    # take at least 10 s on any machine; the others hold their stages until killed
    topology = write_topology(tmp_path, small_model_dir, 2, name="orphans")
    run_dir = tmp_path / "run"
    env = {**tied_env(), DELAY_ENV: "50"}
    parent = subprocess.Popen(parent_command(kind, topology, run_dir), stdin=subprocess.PIPE, env=env,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "parent.log").open("wb"))
    try:
        pids = stage_pids(run_dir, ["s0", "s1"], parent)
        seconds = kill_and_wait_gone(parent, pids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
    print(f"{kind}: 0 of {len(pids)} stages left {seconds:.2f} s after SIGKILL of the parent")
    for sid in pids:
        assert "exited; stopping" in (run_dir / f"{sid}.log").read_text(errors="replace")


def test_a_child_whose_parent_is_already_gone_exits_at_start(tmp_path):
    """The race between fork and the watch: a child told to watch a pid that is not its parent
    (its parent died before it got there) exits at once, non-zero."""
    code = "from skippy_zmq.ops.lifetime import watch_parent; watch_parent('probe'); print('survived')"
    env = {**os.environ, "SKIPPY_PARENT_PID": "1"}   # never this child's parent
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "survived" not in out.stdout
    assert "parent 1 is gone before start" in out.stderr


def test_a_tied_child_is_stopped_by_sigterm_when_its_parent_dies(tmp_path):
    """Without model or stage: a small parent spawns a tied child that watches it, the parent is
    SIGKILLed, the child hears SIGTERM (its handler writes a file) within GONE_WITHIN_S."""
    marker = tmp_path / "heard"
    child = ("import os, signal, sys, time\n"
             "from skippy_zmq.ops.lifetime import watch_parent\n"
             f"signal.signal(signal.SIGTERM, lambda *_: (open({str(marker)!r}, 'w').write('x'), os._exit(0)))\n"
             "watch_parent('child')\n"
             "print('watching', flush=True)\n"
             "signal.pause()\n")
    parent = ("import subprocess, sys\n"
              "from skippy_zmq.ops.lifetime import tied_env\n"
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], env=tied_env())\n"
              "print(p.pid, flush=True)\n"
              "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "watching"
        seconds = kill_and_wait_gone(proc, {"child": child_pid})
    finally:
        if proc.poll() is None:
            proc.kill()
    assert marker.read_text() == "x" and seconds < GONE_WITHIN_S


@pytest.mark.slow
def test_sigterm_stops_a_serving_stage_promptly(small_model_dir, tmp_path):
    """SIGTERM: the stage drains, says it stopped and exits within GONE_WITHIN_S (the issue saw
    stages outlive 8 s); its ports are then free for the next run."""
    from procs import running_pipeline

    topology = write_topology(tmp_path, small_model_dir, 2, name="sigterm")
    with running_pipeline(topology, tmp_path / "run") as (_engine, _tok, topo, procs):
        stage = procs[0]   # the last stage (spawned first)
        t0 = time.monotonic()
        stage.send_signal(signal.SIGTERM)
        stage.wait(timeout=60)
        seconds = time.monotonic() - t0
    print(f"stage stopped {seconds:.2f} s after SIGTERM (code {stage.returncode})")
    assert seconds < GONE_WITHIN_S and stage.returncode == 0
    assert "stopped" in (tmp_path / "run" / f"{topo.stages[-1].id}.log").read_text(errors="replace")


def test_settle_heap_keeps_full_collections_off_what_is_alive():
    """After settle_heap, a full collection no longer scans the objects alive at the call (they are
    frozen), and garbage made before it is freed, not frozen."""
    import gc

    from skippy_zmq.ops.lifetime import settle_heap

    class Node:
        pass

    kept = [Node() for _ in range(1000)]
    garbage = Node()
    garbage.self = garbage          # a cycle only the collector frees
    probe = weakref.ref(garbage)
    del garbage
    try:
        frozen = settle_heap()
        assert probe() is None                          # collected first
        assert frozen >= len(kept)   # (other threads may free frozen objects right after: no equality)
        assert all(not any(o is k for o in gc.get_objects(2)) for k in kept[:3])   # out of generation 2
    finally:
        gc.unfreeze()
