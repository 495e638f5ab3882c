"""Hop benchmark: a simulated per-hop network delay against the hop-count model.

Every stage holds what it forwards to the next stage for SKIPPY_HOP_DELAY_MS
while it goes on working (stage/loop.py: a link's latency, not its bandwidth, so
several messages can be on the way at once); replies to the driver are not
delayed. With S stages a
decoded token crosses S - 1 inter-stage hops, then the final stage returns the
token straight to the driver, so

    direct return (ours):  ms/token = base(S) + (S - 1) * delay
    relay back the chain:  ms/token = base(S) + 2 (S - 1) * delay

where base(S) is the same topology's ms/token with no delay. The relay design
pays the S - 1 hops again on the way back; that is the saving. On a real
network the driver->stage 0 and final->driver links would add one delay each
to both designs, so the saving is unchanged. A stream that runs on (the ring,
stage/run_on.py) sends its next step from the final stage straight to stage 0,
a stage-to-stage link this simulation delays: S delays a token where the
driver's round costs S - 1 here (its two links left undelayed) and S + 1 on a
real network. `bench peers`' relay rows delay every link and compare the two.

Each point runs on its own pipeline (the delay is read at stage start), so on
a shared machine the stages' compute speed can drift between points. base(S)
is therefore corrected by the compute the traces report for the point itself:
base = (no-delay ms/token - no-delay compute) + this point's compute.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from skippy_zmq.devtools.bench.common import print_table, stage_overrides, synthetic_prompt
from skippy_zmq.devtools.bench.pipeline import BENCH_TOPOLOGY, TraceLog, measure, stream_prompts
from skippy_zmq.devtools.harness import running_pipeline, write_topology

DELAY_ENV = "SKIPPY_HOP_DELAY_MS"


def hop_model(base_ms: float, delay_ms: float, stages: int) -> dict[str, float]:
    """ms/token predicted by the hop count, for the direct-return and the relay-back designs."""
    forward = stages - 1
    direct = base_ms + forward * delay_ms
    relay = base_ms + 2 * forward * delay_ms
    return {"model_direct_ms": round(direct, 2), "model_relay_ms": round(relay, 2),
            "saving_ms": round(relay - direct, 2)}


def corrected_base(base_ms: float, base_compute_ms: float | None, compute_ms: float | None) -> float:
    """The no-delay ms/token with its compute swapped for the compute measured at this point."""
    if base_compute_ms is None or compute_ms is None:
        return base_ms
    return base_ms - base_compute_ms + compute_ms


def hop_row(stages: int, delay_ms: float, base_ms: float, measured_ms: float,
            compute_ms: float | None = None) -> dict[str, Any]:
    """One table row: the measurement beside both models; error is measured minus the direct model."""
    model = hop_model(base_ms, delay_ms, stages)
    return {"stages": stages, "delay_ms": delay_ms, "forward_hops": stages - 1, "compute_ms": compute_ms,
            "base_ms": round(base_ms, 2), "measured_ms": round(measured_ms, 2),
            "model_direct_ms": model["model_direct_ms"], "model_relay_ms": model["model_relay_ms"],
            "error_ms": round(measured_ms - model["model_direct_ms"], 2),
            "saved_vs_relay_ms": round(model["model_relay_ms"] - measured_ms, 2)}


@contextmanager
def hop_delay(delay_ms: float) -> Iterator[None]:
    """Stage processes spawned inside inherit the delay; the variable is restored afterwards."""
    previous = os.environ.get(DELAY_ENV)
    os.environ[DELAY_ENV] = f"{delay_ms:g}"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DELAY_ENV, None)
        else:
            os.environ[DELAY_ENV] = previous


def ms_per_token(model: Path, tmp: Path, stages: int, delay_ms: float, new_tokens: int,
                 on: dict[str, Any]) -> tuple[float, float | None]:
    """(median inter-token ms, median step compute ms) of one stream on a fresh S-stage pipeline;
    `on` is the stages' device and dtype."""
    name = f"hops-{stages}-{delay_ms:g}"
    path = write_topology(tmp, model, stages, name=name, **BENCH_TOPOLOGY, **on)
    with hop_delay(delay_ms), running_pipeline(path, tmp / name, warm=True) as (engine, tokenizer, topology, _):
        log = TraceLog()
        engine.on_reply_hooks.append(log)
        prompt = synthetic_prompt(tokenizer, 64)
        measure(engine, stream_prompts(prompt, 1, salt=100), 4, strict=False)   # compile outside the timing
        m = measure(engine, [prompt], new_tokens, log, tuple(s.id for s in topology.stages))
        return m["itl_p50_ms"], m["step_compute_ms"]


def baselines(prior: dict[str, Any] | None) -> dict[int, tuple[float, float | None]]:
    """No-delay (ms/token, compute) from the pipeline suite of the same run (same topology settings)."""
    rows = ((prior or {}).get("pipeline") or {}).get("rows", [])
    return {r["stages"]: (r["itl_p50_ms"], r.get("step_compute_ms")) for r in rows if r["streams"] == 1}


def bench_hops(args: argparse.Namespace, tables: list[str], prior: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    stage_counts, delays = (2, 3), (5.0, 20.0)
    new_tokens = 16 if args.quick else 32
    model = Path(args.model).absolute()
    tmp = Path(tempfile.mkdtemp(prefix="skippy-bench-hops-"))
    base = baselines(prior)
    rows = []
    for stages in stage_counts:
        if stages not in base:
            base[stages] = ms_per_token(model, tmp, stages, 0.0, new_tokens, stage_overrides(args))
        for delay in delays:
            measured, compute = ms_per_token(model, tmp, stages, delay, new_tokens, stage_overrides(args))
            rows.append(hop_row(stages, delay, corrected_base(*base[stages], compute), measured, compute))
    tables.append(print_table(
        f"simulated hop delay ({DELAY_ENV}; 1 stream, {new_tokens} tokens per point, median ms/token)", rows,
        "direct = base + (S-1)·delay (our stages forward down the chain, the last one returns the token "
        "straight to the driver); relay = base + 2(S-1)·delay (the token travels back through the chain). "
        "base = the no-delay ms/token, its compute replaced by this point's (compute_ms, from the traces); "
        "saved_vs_relay_ms = relay model - measured."))
    return {"new_tokens": new_tokens, "no_delay": {s: {"ms_per_token": b[0], "compute_ms": b[1]}
                                                   for s, b in base.items()}, "rows": rows}
