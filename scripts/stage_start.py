#!/usr/bin/env python3
"""Time one stage's start in this process: restore, then the warm-up the factory runs before READY,
split into JAX's own phases (trace, lower to MLIR, XLA compile, persistent-cache reads), with the
persistent cache's hits and writes and the cache directory's file count before and after.

    # cold: an empty cache directory; warm: run it again with the same directory
    .venv/bin/python scripts/stage_start.py --topology topologies/smollm2-2stage.yaml --stage s0 \\
        --weights q4 --cache "$(mktemp -d)"
    # every shape the stage serves (each attention bucket), not only what the factory warms
    ... --coverage full

One JSON line on stdout. `--explain` turns on jax_explain_cache_misses (why a lookup missed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
    t0, c0 = time.perf_counter(), time.process_time()
    worker = build_worker(topology, stage)
    start_s, start_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    runner = worker.runner
    factory_shapes = len(runner.stats.shapes)
    full_s = 0.0
    if args.coverage == "full":
        rows = stage_buckets(topology, stage.kv_lanes).decode_rows[:2]
        full_s = runner.warmup(rows=rows, attn_lens=runner.attn_buckets())
    print(json.dumps({"stage": stage.id, "layers": [stage.start, stage.end], "weights": stage.weights,
                      "coverage": args.coverage, "start_s": round(start_s, 2), "start_cpu_s": round(start_cpu_s, 2),
                      "full_extra_s": round(full_s, 2),
                      "factory_shapes": factory_shapes, "shapes": len(runner.stats.shapes),
                      **{k: round(v, 2) for k, v in sorted(phases.items())}, **dict(events),
                      "cache_files_before": before, "cache_files_after": files(cache)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
