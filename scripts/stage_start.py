#!/usr/bin/env python3
"""Time one stage's start in this process: restore, then the warm-up the factory runs before READY,
split into JAX's own phases (trace, lower to MLIR, XLA compile, persistent-cache reads), with the
persistent cache's hits and writes and the cache directory's file count before and after.

    # cold: an empty cache directory; warm: run it again with the same directory
    .venv/bin/python scripts/stage_start.py --topology topologies/smollm2-2stage.yaml --stage s0 \\
        --weights q4 --cache "$(mktemp -d)"
    # every shape the stage serves (each attention bucket), not only what the factory warms
    ... --coverage full

    # a fresh machine: an empty kernel cache too (the native kernel is built, timed apart), and the
    # decode step's cost after READY (median wall and CPU ms of 1- and 4-row steps) to compare trees
    XDG_CACHE_HOME="$(mktemp -d)" .venv/bin/python scripts/stage_start.py \
        --topology topologies/smollm2-1stage.yaml --cache "$(mktemp -d)" --decode 40

One JSON line on stdout. `--explain` turns on jax_explain_cache_misses (why a lookup missed). CPU
seconds (process time, every thread; the kernel build's compiler processes are counted apart) are
quoted beside wall seconds because on a shared machine the wall time mostly measures the others'
load, which is quoted too (os.getloadavg before and after).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippy_zmq.cli import configure_jax, configure_logging  # noqa: E402

PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "xla_compile_s",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s"}
EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits",
          "/jax/compilation_cache/cache_misses": "cache_writes"}


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the kernel build's compiler runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def kernel_build() -> dict:
    """Build (or find) and load the native kernel, timed on its own before the stage starts."""
    from skippy_zmq.model import quant

    t0, c0 = time.perf_counter(), children_cpu_s()
    isa = quant.kernel_isa()
    return {"kernel_isa": isa, "kernel_s": round(time.perf_counter() - t0, 2),
            "kernel_cc_cpu_s": round(children_cpu_s() - c0, 2)}


def decode_ms(runner, steps: int, context: int = 26) -> dict:
    """Median wall and CPU milliseconds of a decode step with 1 and 4 rows after a `context`-token prefill."""
    import numpy as np

    out = {}
    ids = np.arange(1, context + 1, dtype=np.int32) % 1000 + 1
    for rows in (1, 4):
        lanes = np.arange(rows)
        for lane in lanes:
            runner.prefill(int(lane), ids, 0, output="none")
        tok, wall, cpu = np.full(rows, 5, np.int32), [], []
        for i in range(steps + 3):     # the first three: a step's first runs are slower
            t, c = time.perf_counter(), time.process_time()
            runner.decode(lanes, tok, np.full(rows, context + i))
            if i >= 3:
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
        out[f"decode{rows}_ms"] = round(1000 * float(np.median(wall)), 2)
        out[f"decode{rows}_cpu_ms"] = round(1000 * float(np.median(cpu)), 2)
    return out


def files(path: Path) -> int:
    return sum(1 for _ in path.iterdir()) if path.is_dir() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", required=True)
    ap.add_argument("--stage", default="s0")
    ap.add_argument("--weights", help="override every stage's weights format (f32 | int8 | q4)")
    ap.add_argument("--cache", required=True, help="persistent JAX cache directory ('off': none)")
    ap.add_argument("--coverage", choices=("factory", "full"), default="factory",
                    help="full: after the factory's warm-up, every attention bucket up to the capacity")
    ap.add_argument("--explain", action="store_true", help="jax_explain_cache_misses")
    ap.add_argument("--decode", type=int, default=0, metavar="STEPS",
                    help="after the start, time this many decode steps with 1 and with 4 rows")
    ap.add_argument("--decode-context", type=int, default=26, metavar="TOKENS",
                    help="the prompt those decode steps follow (default 26; bench peers' single rows: 512)")
    ap.add_argument("--idle", action="store_true",
                    help="after the start, run the idle warm-ups the stage loop runs after READY (timed)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args()
    configure_logging(args.log_level)
    configure_jax(args.cache)
    import jax
    from jax import monitoring

    from skippy_zmq.stage.factory import build_worker, stage_buckets
    from skippy_zmq.config.topology_yaml import load_topology

    if args.explain:
        jax.config.update("jax_explain_cache_misses", True)
    phases: dict[str, float] = defaultdict(float)
    events: Counter = Counter()
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: phases.__setitem__(PHASES[name], phases[PHASES[name]] + secs)
        if name in PHASES else None)
    monitoring.register_event_listener(lambda name, **_: events.update([EVENTS[name]]) if name in EVENTS else None)

    topology = load_topology(args.topology)
    if args.weights:
        topology = dataclasses.replace(topology, stages=tuple(dataclasses.replace(s, weights=args.weights)
                                                              for s in topology.stages))
    stage = topology.stage(args.stage)
    cache = Path(args.cache)
    before = files(cache)
    load_before = os.getloadavg()[0]
    kernel = kernel_build()
    t0, c0 = time.perf_counter(), time.process_time()
    worker = build_worker(topology, stage)
    start_s, start_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    runner = worker.runner
    factory_shapes, layered_shapes = len(runner.stats.shapes), len(runner.stats.layered)
    t1, c1 = time.perf_counter(), time.process_time()
    runner.join_behind()     # a stop-gap stage's whole-slice compiles, then its idle warm-ups, as the loop runs them
    behind_s, behind_cpu_s = time.perf_counter() - t1, time.process_time() - c1
    idle_s = sum(fn() or 0.0 for fn in worker.warm_later) if args.idle else 0.0
    runner.stopgap = False   # the steady state the idle warm-ups end in: every shape runs the whole-slice step
    full_s = 0.0
    if args.coverage == "full":
        rows = stage_buckets(topology, stage.kv_lanes).decode_rows[:2]
        full_s = runner.warmup(rows=rows, attn_lens=runner.attn_buckets())
    decode = decode_ms(runner, args.decode, args.decode_context) if args.decode else {}
    print(json.dumps({"stage": stage.id, "layers": [stage.start, stage.end], "weights": stage.weights,
                      "coverage": args.coverage, "start_s": round(start_s, 2), "start_cpu_s": round(start_cpu_s, 2),
                      "behind_s": round(behind_s, 2), "behind_cpu_s": round(behind_cpu_s, 2),
                      "idle_s": round(idle_s, 2), "full_extra_s": round(full_s, 2),
                      "factory_shapes": factory_shapes, "layered_shapes": layered_shapes,
                      "shapes": len(runner.stats.shapes),
                      **{k: round(v, 2) for k, v in sorted(phases.items())}, **dict(events),
                      "cache_files_before": before, "cache_files_after": files(cache), **kernel, **decode,
                      "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                      "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
