#!/usr/bin/env python3
"""What each compiled decode shape costs a stage's peak memory: one stage built in this process
(stage.factory.build_worker, as a stage process builds it), then the idle warm-up a serving stage
runs after READY (every (rows, tokens) a DECODE can bring at every attention length), then one run
of every one of those shapes at the longest length. VmHWM at each mark, beside placement.py's
prediction; one JSON line at the end (placement.OVERHEAD_* and PER_SHAPE_LAYER come from it).

    .venv/bin/python scripts/rss_shapes.py --model models/smollm2-135m-instruct --stages 2 --index 0
    .venv/bin/python scripts/rss_shapes.py --model models/random/llama-3.2-1b-L16-s0-q4 --weights q4 \
        --stages 1 --context 656
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippy_zmq.cli import configure_jax  # noqa: E402

GiB = 1 << 30


def vm(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024 / GiB
    raise KeyError(key)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--index", type=int, default=0, help="which stage of the split to build")
    p.add_argument("--weights", default="f32")
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--max-draft", type=int, default=8, help="the driver's max_draft; 0: no speculation")
    a = p.parse_args()
    configure_jax()
    from skippy_zmq.devtools.harness import write_topology
    from skippy_zmq.stage import factory
    from skippy_zmq.config.topology_yaml import load_topology

    spec = {"method": "ngram", "max_draft": a.max_draft} if a.max_draft > 0 else {"method": "off"}
    path = write_topology(Path(tempfile.mkdtemp()), a.model.absolute(), a.stages, name="shapes",
                          weights=a.weights, kv_lanes=a.lanes, cache={"mode": "disabled"},
                          driver__max_sessions=a.lanes, driver__max_context=a.context, driver__speculative=spec)
    topo = load_topology(path)
    stage = topo.stages[a.index]
    need = factory.predict(topo, stage)
    worker = factory.build_worker(topo, stage)
    runner = worker.runner
    marks = {"ready": vm("VmHWM")}
    ready_shapes = len(runner.stats.shapes)
    print(f"stage {stage.id} [{stage.start}, {stage.end}) READY: {ready_shapes} shapes, hwm {marks['ready']:.3f} GiB",
          flush=True)
    for warm in worker.warm_later:
        warm()
    marks["idle_warm"] = vm("VmHWM")
    warm_shapes = len(runner.stats.shapes)
    print(f"after the idle warm-up: {warm_shapes} shapes, hwm {marks['idle_warm']:.3f} GiB", flush=True)
    width = () if runner.first else (runner.cfg.d_model,)
    dtype = np.int32 if runner.first else np.float32
    pos = runner.capacity - 17
    for rows, t in factory.reachable_shapes(topo, runner.buckets):
        runner.step(np.arange(rows), np.zeros((rows * t,) + width, dtype), np.full(rows, pos), np.full(rows, t),
                    "logits" if runner.last else "hidden")
    marks["run_all"] = vm("VmHWM")
    print(f"after running every decode shape at {runner.capacity} positions: hwm {marks['run_all']:.3f} GiB")
    layers = stage.end - stage.start
    fixed = (need.weights + need.kv) / GiB
    row = {"model": a.model.name, "weights": a.weights, "stage": stage.id, "layers": layers,
           "shapes_ready": ready_shapes, "shapes_warm": warm_shapes, "weights_kv_gib": round(fixed, 3),
           "predicted_gib": round(need.total / GiB, 3),
           **{f"hwm_{k}_gib": round(v, 3) for k, v in marks.items()},
           "overhead_ready_mib": round((marks["ready"] - fixed) * 1024),
           "overhead_final_mib": round((marks["run_all"] - fixed) * 1024),
           "peak_over_predicted": round(marks["run_all"] * GiB / need.total, 3)}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
