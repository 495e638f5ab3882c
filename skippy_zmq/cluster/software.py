"""What a stage's own software costs per step, beside its compute: measured on the host (inside
its cgroup, so a host under a CPU quota pays for its Python at the quota's rate, like its layers).

A stage receives a step, decodes it, checks and places its rows, runs them, appends their tokens,
builds its trace and the outbound message, and sends it (stage/loop.py, stage/worker.py).
`bench cluster`'s telemetry showed this receive-to-send time less the compute at 0.35-0.5 ms a
stage on the loaded 2-core test machine, and nothing before serving measured it: the 1-stream
predictions came out short by that much a stage. `handle_ms` times the real path: a real
StageWorker over the measuring runner handles real DECODE frames (wire.decode, worker.handle, the
outbound's wire.encode); its software is that time less the compute its own trace reports.

The median of (step - compute) is close to the software's CPU time: a quota's throttling lands in
the much longer compute. measure.py divides it by the host's quota (cores) for the sustained rate
ops/speed.py expects; a one-stream step's burst then takes it back to about the CPU time.

No sockets here: a message's send and receive over ZeroMQ is measure.py's `message_ms`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

SESSION_BASE = 1      # the measuring sessions' ids (a private SessionTable: nothing else shares them)


def _frames(rows: int, width: int) -> list[bytes]:
    """A DECODE of `rows` rows (one session each, position 0: each call re-runs the same position,
    so the sessions never grow), encoded as the previous stage sends it."""
    from skippy_zmq.protocol import wire

    msg = wire.Message(wire.Kind.DECODE, 1, SESSION_BASE, position=0, tokens=np.zeros(rows, np.int32),
                       positions=np.zeros(rows, np.int32),
                       sessions=np.arange(SESSION_BASE, SESSION_BASE + rows, dtype=np.uint64),
                       activation=np.zeros((rows, width), np.float32))
    msg.extras["trace"] = [{"stage": "before", "compute_ms": 0.0, "rows": rows}]
    return [bytes(f) for f in wire.encode(msg)]


def handle_ms(runner: Any, rows: int, lanes: int, repeats: int = 5, calls: int = 10) -> dict[str, float]:
    """{"handle_ms", "compute_ms", "software_ms"}: medians over `repeats` samples of `calls` steps
    through a real StageWorker on `runner` (its KV holding `lanes` lanes) as a middle stage
    (activations in, activations out)."""
    from skippy_zmq.protocol import wire
    from skippy_zmq.stage.sessions import SessionTable
    from skippy_zmq.stage.types import StageInfo
    from skippy_zmq.stage.worker import StageWorker

    worker = StageWorker(StageInfo("measure", first=False, last=False, width=runner.cfg.d_model),
                         runner, SessionTable(lanes))
    frames = _frames(rows, runner.cfg.d_model)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = worker.handle(wire.decode(frames))
        wire.encode(out[0].message)
        total = 1000 * (time.perf_counter() - t0)
        if len(out) != 1 or out[0].message.kind != wire.Kind.DECODE:
            raise RuntimeError(f"the measuring stage answered {[o.message.kind.name for o in out]}")
        return total, float(out[0].message.extras["trace"][-1]["compute_ms"])

    step()   # compiles, first-run costs
    totals, computes, software = [], [], []
    for _ in range(repeats):
        samples = [step() for _ in range(calls)]
        totals.append(statistics.median(t for t, _ in samples))
        computes.append(statistics.median(c for _, c in samples))
        software.append(statistics.median(t - c for t, c in samples))
    return {"handle_ms": round(statistics.median(totals), 4), "compute_ms": round(statistics.median(computes), 4),
            "software_ms": round(max(0.0, statistics.median(software)), 4)}
