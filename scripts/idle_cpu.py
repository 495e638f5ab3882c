"""CPU an idle stage costs, with a driver and without one (issue 20's goal: <= 1% of a core).

Spawns a 2-stage pipeline of a converted model on free loopback ports, waits for READY and
for every stage's warm-up compiles, then reads each stage's utime + stime (/proc) over
--seconds with the driver connected, and again after the driver closed. Prints a table and
writes JSON (--out).

    .venv/bin/python scripts/idle_cpu.py --model models/smollm2-135m-instruct --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from skippy_zmq.devtools.harness import running_pipeline, write_topology

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK   # utime, stime


def wait_for_line(log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and text in log.read_text(errors="replace"):
            return
        time.sleep(0.5)   # polling a log file for a line; not synchronisation between our processes
    raise TimeoutError(f"{log} did not say {text!r} within {timeout:g} s")


def measure(pids: dict[str, int], seconds: float) -> dict[str, float]:
    before = {sid: cpu_seconds(pid) for sid, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)   # the measurement window itself
    wall = time.monotonic() - t0
    return {sid: round(100 * (cpu_seconds(pid) - before[sid]) / wall, 3) for sid, pid in pids.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--out", default="runs/idle_cpu.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        topo = write_topology(Path(tmp), args.model, args.stages, name="idle")
        with running_pipeline(topo, run_dir) as (engine, _tok, topology, procs):
            pids = {s.id: p.pid for s, p in zip(reversed(topology.stages), procs)}
            for sid in pids:
                wait_for_line(run_dir / f"{sid}.log", f"stage {sid} warm-up compiles done", 600)
            with_driver = measure(pids, args.seconds)
            engine.close()
            wait_for_line(run_dir / f"{topology.stages[-1].id}.log", "driver unreachable",
                          topology.driver.dead_after_s + 30)
            without_driver = measure(pids, args.seconds)
    result = {"seconds": args.seconds, "model": args.model,
              "cpu_percent_of_a_core": {"with_driver": with_driver, "without_driver": without_driver}}
    print(f"idle stage CPU, % of one core over {args.seconds:g} s")
    print(f"{'stage':<8}{'with driver':>14}{'no driver':>12}")
    for sid in pids:
        print(f"{sid:<8}{with_driver[sid]:>14.3f}{without_driver[sid]:>12.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
