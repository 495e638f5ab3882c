"""`bench cluster`'s ring measurement: what a token pays outside the stages, measured before any
split runs, on a two-stage pipeline of real processes (the driver here, both stages on the
fastest host, the layers halved), so that ops/speed.py can charge it (`Links.hop_fixed_ms`,
`Links.driver_ms`). One stream; from the stages' telemetry (medians over the decode steps):

    transit       = s1's receive - s0's send (encoding, the wire, s1 waking and decoding)
    hop_fixed_ms  = transit - rtt / 2         (the link's own share is charged apart)
    driver_ms     = token - Σ stage receive-to-send - transit - 2 · (rtt / 2 + hop_fixed_ms)

hop_fixed_ms is each hop's software beside its link, which the link probe's empty round trips do
not see; driver_ms is the driver's own share of a token (its receive, scheduler, hand-off to the
request, send). On the loaded 2-core test machine the splits' telemetry put the first at 0.4-0.6
ms a hop, the second at 1.5-2.3 ms a token. The driver loop's own clock (PipelineEngine.
loop_busy_s a token) is reported beside them: under load it also counts time the loop thread
waited for a core, so it is not what is charged.

`machine_ms` gauges the machine's speed at a moment (bench cluster times it after the hosts'
measurement and before each row): the recorded rows that missed their predictions were the rows
where h100, which has no quota, served its stage at 0.83-0.87 of its own measurement.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, ContextManager

from skippy_zmq.ops.speed import Links, Stage


def measure_ring(running: Callable[[tuple[Stage, ...], str], ContextManager[tuple[Any, Any]]], host: str,
                 n_layers: int, rtt_ms: float, prompt_tokens: int, new_tokens: int) -> dict[str, float]:
    """{"ms_per_token", "stage_ms", "driver_ms", "hop_fixed_ms"} of a one-stage ring on `host`
    (`running(stages, name)`: the split running, as (engine, tokenizer); rtt_ms: that host's
    measured round trip to the driver, charged apart)."""
    from skippy_zmq.devtools.bench.common import synthetic_prompt
    from skippy_zmq.devtools.bench.pipeline import TraceLog, measure

    half = n_layers // 2
    with running((Stage(host, 0, half), Stage(host, half, n_layers)), "ring") as (engine, tokenizer):
        log = TraceLog()
        engine.on_reply_hooks.append(log)
        base = synthetic_prompt(tokenizer, prompt_tokens)
        measure(engine, [base], 4, strict=False)   # compiles what one stream uses
        t0, busy0 = time.perf_counter(), engine.loop_busy_s
        one = measure(engine, [base], new_tokens, log, ("s0", "s1"))
        loop_ms = 1000 * (engine.loop_busy_s - busy0) / new_tokens
        steps = [t for t in log.window(t0, time.perf_counter(), steps_only=True)
                 if len(t) == 2 and all("recv_ns" in h and "send_ns" in h for h in t)]
    if not steps:
        raise RuntimeError("the ring's replies carried no stage telemetry")
    inside = statistics.median(sum(h["send_ns"] - h["recv_ns"] for h in t) / 1e6 for t in steps)
    transit = statistics.median((t[1]["recv_ns"] - t[0]["send_ns"]) / 1e6 for t in steps)
    token = one["itl_p50_ms"]
    hop = max(0.0, transit - rtt_ms / 2)
    driver = max(0.0, token - inside - transit - 2 * (rtt_ms / 2 + hop))
    found = {"ms_per_token": token, "stages_ms": round(inside, 3), "transit_ms": round(transit, 3),
             "hop_fixed_ms": round(hop, 3), "driver_ms": round(driver, 3), "driver_loop_ms": round(loop_ms, 3)}
    print(f"[bench cluster] ring on {host}: {found}", flush=True)
    return found


def with_ring(links: Links, ring: dict[str, float]) -> Links:
    """`links` charging the ring's driver time and per-hop software too."""
    return dataclasses.replace(links, driver_ms=ring["driver_ms"], hop_fixed_ms=ring["hop_fixed_ms"])


PROBE_BYTES = 64 << 20   # more than a core's caches hold: streamed from memory, as a decode step's layers


def machine_ms(seconds: float = 0.3) -> float:
    """The machine's speed now, in this process: the median ms of a single-threaded sum over
    PROBE_BYTES of float32 (numpy's reduction: no thread pool), repeated for `seconds`. Its ratio
    to the same figure when the hosts were measured says how much faster (> 1) the machine runs
    a row than it ran their measurement; nothing plans with it (docs/cluster.md "Why the rows miss")."""
    import numpy as np

    data = np.ones(PROBE_BYTES // 4, np.float32)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        data.sum()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)
