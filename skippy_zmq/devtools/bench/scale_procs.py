"""Process measurements for the scale bench: a pipeline whose stages start one after another, a
subprocess's wall time and peak RSS, a live process's peak RSS, and a stage's start times from its
log. Linux (/proc, wait4)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

# stage/factory.py: "stage s0 layers [0, 16) on cpu: restored in 3.2s, compiled in 11.0s"
START_LINE = re.compile(r"stage (\S+) layers \[(\d+), (\d+)\) on \S+: restored in ([\d.]+)s, compiled in ([\d.]+)s")


def run_measured(cmd: list[str], log: Path) -> dict[str, Any]:
    """Run cmd to completion (output to `log`); exit code, wall seconds and its peak RSS in bytes
    (wait4's ru_maxrss for this child alone, KiB on Linux)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1), "peak_rss": usage.ru_maxrss * 1024}


def logged_peak_gib(log: Path) -> float | None:
    """The last "peak RSS X GiB" a command logged of itself (convert and random-model do), or None."""
    try:
        found = re.findall(r"peak RSS ([\d.]+) GiB", log.read_text(errors="replace"))
    except OSError:
        return None
    return float(found[-1]) if found else None


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM (the process's peak resident set) from /proc/<pid>/status; None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def stage_start_times(log: Path) -> dict[str, dict[str, float]]:
    """Per stage id in a stage log: the last start's restore and compile seconds."""
    found: dict[str, dict[str, float]] = {}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return found
    for m in START_LINE.finditer(text):
        found[m.group(1)] = {"restored_s": float(m.group(4)), "compiled_s": float(m.group(5))}
    return found


@contextmanager
def staggered_pipeline(topology_path: Path, run_dir: Path, timeout: float = 1800.0) -> Iterator:
    """Like harness.running_pipeline, but each stage (downstream first) starts only once the one
    before it is READY: restores never overlap, so a big model's restore transients are paid once,
    not once per stage at the same time, and each stage's start time is its own. Yields (engine,
    topology, procs by stage id, seconds from spawn to READY by stage id)."""
    from skippy_zmq.api.main import open_engine
    from skippy_zmq.devtools.harness import wait_warmed
    from skippy_zmq.ops.launch import spawn_stage, stop_processes
    from skippy_zmq.config.topology_yaml import load_topology

    topology = load_topology(topology_path)
    engine, _ = open_engine(topology)
    procs: dict[str, subprocess.Popen] = {}
    ready_s: dict[str, float] = {}
    try:
        for stage in reversed(topology.stages):
            t0 = time.perf_counter()
            procs[stage.id] = spawn_stage(topology_path, stage, run_dir, ["--log-level", "INFO"])
            _wait_stage_ready(engine, stage.id, procs[stage.id], run_dir, timeout)
            ready_s[stage.id] = round(time.perf_counter() - t0, 1)
        if not engine.wait_ready(timeout):
            raise TimeoutError(engine.not_ready_reason())
        wait_warmed(engine, timeout, list(procs.values()), run_dir)   # peaks include every reachable shape
        yield engine, topology, procs, ready_s
    finally:
        engine.close()
        stop_processes(list(procs.values()))


def _wait_stage_ready(engine: Any, stage_id: str, proc: subprocess.Popen, run_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not engine.stages[stage_id].ready:   # set by the stage's READY (the driver thread)
        if proc.poll() is not None:
            raise RuntimeError(f"stage {stage_id} exited with code {proc.returncode} during startup; "
                               f"see {run_dir / (stage_id + '.log')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"stage {stage_id} not READY after {timeout:g} s")
        engine.wait_ready(0.25)   # a bounded wait on the driver's ready event (set only when all are)
