"""`bench cluster`'s ring measurement: what a token pays outside the stages, measured before any
split runs, on a one-stage pipeline of real processes (the driver here, the whole model on the
fastest host), so that ops/speed.py can charge it (`Links.driver_ms`, `Links.hop_fixed_ms`).

One stream of NEW_TOKENS tokens; from the stage's telemetry and the driver's loop clock:

    driver_ms     = the driver loop's own time a token (PipelineEngine.loop_busy_s)
    hop_fixed_ms  = (token - stage's receive-to-send - driver_ms - the two hops' round trip) / 2

the second is each hop's software beside its link (encoding, the receiver waking and decoding),
which the link probe's empty round trips do not see. On the loaded 2-core test machine the
splits' telemetry put it at 0.4-0.6 ms a hop and the driver's loop at about 1.9 ms a token.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from skippy_zmq.ops.speed import Links, Stage


def measure_ring(hosts: Any, host: str, n_layers: int, model: Path, weights: str, tmp: Path,
                 rtt_ms: float) -> dict[str, float]:
    """{"ms_per_token", "stage_ms", "driver_ms", "hop_fixed_ms"} of a one-stage ring on `host`
    (rtt_ms: that host's measured round trip to the driver, charged apart)."""
    from skippy_zmq.devtools.bench import cluster
    from skippy_zmq.devtools.bench.common import synthetic_prompt
    from skippy_zmq.devtools.bench.pipeline import TraceLog, measure

    stages = (Stage(host, 0, n_layers),)
    path = cluster.write_split_topology(tmp, model, hosts, stages, weights, "ring")
    with cluster.split_running(path, hosts, stages, tmp / "run-ring") as (engine, tokenizer):
        log = TraceLog()
        engine.on_reply_hooks.append(log)
        base = synthetic_prompt(tokenizer, cluster.PROMPT_TOKENS)
        measure(engine, [base], 4, strict=False)   # compiles what one stream uses
        t0, busy0 = time.perf_counter(), engine.loop_busy_s
        one = measure(engine, [base], cluster.NEW_TOKENS, log, ("s0",))
        loop_ms = 1000 * (engine.loop_busy_s - busy0) / cluster.NEW_TOKENS
        steps = [t for t in log.window(t0, time.perf_counter(), steps_only=True)
                 if t and "recv_ns" in t[0] and "send_ns" in t[0]]
    inside = statistics.median((t[0]["send_ns"] - t[0]["recv_ns"]) / 1e6 for t in steps) if steps else 0.0
    token = one["itl_p50_ms"]
    hop = max(0.0, (token - inside - loop_ms - rtt_ms) / 2)
    found = {"ms_per_token": token, "stage_ms": round(inside, 3), "driver_ms": round(loop_ms, 3),
             "hop_fixed_ms": round(hop, 3)}
    print(f"[bench cluster] ring on {host}: {found}", flush=True)
    return found


def with_ring(links: Links, ring: dict[str, float]) -> Links:
    """`links` charging the ring's driver time and per-hop software too."""
    import dataclasses

    return dataclasses.replace(links, driver_ms=ring["driver_ms"], hop_fixed_ms=ring["hop_fixed_ms"])
