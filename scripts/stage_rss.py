#!/usr/bin/env python3
"""Measure stage processes' resident memory against skippy_zmq/ops/placement.py's prediction.

For each stage count and weights format: start real stage processes (harness.running_pipeline,
prefix cache off so the cache term is 0), run a few greedy requests, read every stage's VmRSS
from /proc, and print RSS now and at its peak (VmHWM: the load, compiles and requests included), the
predicted weight and KV bytes, the runtime overhead this implies (peak - weights - KV) and RSS and peak
over the predicted total. (placement.py's overhead constants now come from scripts/rss_shapes.py.)

    .venv/bin/python scripts/stage_rss.py --stages 1,2,3 --weights f32,int8,q4 --requests 4

--timeline STAGE_INDEX: build that one stage in this process instead (stage.factory.build_worker on
the same topology), sample VmRSS and VmHWM from /proc/self/status every 0.2 s through restore,
compile, READY and the requests (a prefill of up to 300 positions and 8 decode steps each), and print
the phase marks and the samples: where a stage's peak comes from (placement.py's LOAD_* and overhead).

    .venv/bin/python scripts/stage_rss.py --model models/scale-src/llama-8b-q4 --stages 2 --weights q4 \
        --context 304 --timeline 0 --requests 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippy_zmq.ops import placement  # noqa: E402
from skippy_zmq.config.model import ModelConfig  # noqa: E402
from skippy_zmq.engine.request import GenRequest  # noqa: E402
from skippy_zmq.devtools.harness import running_pipeline, write_topology  # noqa: E402
from skippy_zmq.checkpoint.checkpoint import stored_weights  # noqa: E402
from skippy_zmq.sampling import SamplingParams  # noqa: E402


def proc_rss(pid: int, field: str = "VmRSS") -> int:
    """VmRSS (resident now) or VmHWM (the process's peak resident set) of a live process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure(model: Path, n_stages: int, fmt: str, requests: int, tmp: Path) -> list[dict]:
    path = write_topology(tmp, model, n_stages, name=f"rss-{n_stages}-{fmt}", weights=fmt, cache={"mode": "disabled"})
    cfg = ModelConfig.load(model / "model.json")
    with running_pipeline(path, tmp / f"run-{n_stages}-{fmt}") as (engine, tokenizer, topology, procs):
        ready = {s.id: proc_rss(p.pid) for s, p in zip(reversed(topology.stages), procs)}
        ids = tuple(tokenizer.encode_chat([{"role": "user", "content": "Tell me about the sea."}]))
        for i in range(requests):
            list(engine.generate_blocking(GenRequest(f"rss{i}", ids, SamplingParams(), 32, True)))
        rows = []
        for stage, proc in zip(reversed(topology.stages), procs):
            s = placement.StageSettings(fmt, stage.dtype, stage.kv_dtype, topology.driver.max_context,
                                        stage.kv_lanes, cache_bytes=0, stored=stored_weights(model))
            need = placement.stage_need(cfg, stage.start, stage.end, s)
            rss, peak = proc_rss(proc.pid), proc_rss(proc.pid, "VmHWM")
            rows.append({"stages": n_stages, "weights": fmt, "stage": stage.id, "layers": [stage.start, stage.end],
                         "rss_ready_mib": round(ready[stage.id] / placement.MiB, 1),
                         "rss_mib": round(rss / placement.MiB, 1),
                         "weight_mib": round(need.weights / placement.MiB, 1), "kv_mib": round(need.kv / placement.MiB, 1),
                         "peak_mib": round(peak / placement.MiB, 1),
                         "overhead_mib": round((peak - need.weights - need.kv) / placement.MiB, 1),
                         "rss_over_predicted": round(rss / need.total, 3),
                         "peak_over_predicted": round(peak / need.total, 3)})
        return rows[::-1]


def timeline(model: Path, n_stages: int, fmt: str, index: int, context: int | None, requests: int,
             tmp: Path) -> dict:
    import threading
    import time

    import numpy as np

    from skippy_zmq.model import runner as runner_module
    from skippy_zmq.stage import factory
    from skippy_zmq.config.topology_yaml import load_topology

    from skippy_zmq.cli import configure_jax

    configure_jax()   # the persistent compilation cache, as a stage process has it
    extra = {"driver__max_context": context} if context else {}
    topology = load_topology(write_topology(tmp, model.absolute(), n_stages, name="timeline", weights=fmt,
                                            cache={"mode": "disabled"}, **extra))
    stage = topology.stages[index]
    need = factory.predict(topology, stage)
    gib = lambda field: round(proc_rss(os.getpid(), field) / placement.GiB, 3)   # noqa: E731
    t0, samples, marks, done = time.perf_counter(), [], [], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            samples.append((round(time.perf_counter() - t0, 1), gib("VmRSS"), gib("VmHWM")))

    def mark(name: str) -> None:
        marks.append((round(time.perf_counter() - t0, 1), name, gib("VmRSS"), gib("VmHWM")))

    def phased(fn, begin, end):
        def wrapper(*a, **k):
            mark(begin)
            out = fn(*a, **k)
            mark(end)
            return out
        return wrapper

    threading.Thread(target=sample, daemon=True).start()
    load, warm = factory.loader.load_slice, runner_module.SliceRunner.warmup
    factory.loader.load_slice = phased(load, "restore", "restored")
    runner_module.SliceRunner.warmup = phased(warm, "compile", "compiled")
    try:
        runner = factory.build_worker(topology, stage).runner
    finally:
        factory.loader.load_slice, runner_module.SliceRunner.warmup = load, warm
    mark("ready")
    width = () if runner.first else (runner.cfg.d_model,)
    dtype = np.int32 if runner.first else np.float32
    for i in range(requests):
        n = min(300, runner.capacity - 10)
        runner.prefill(i, np.zeros((n,) + width, dtype), 0, "none" if runner.last else "hidden")
        for t in range(8):
            runner.decode(np.array([i]), np.zeros((1,) + width, dtype), np.array([n + t]))
        mark(f"request {i}")
    done.set()
    peak = max(h for _, _, h in samples + [(0, 0, gib("VmHWM"))])
    return {"stage": stage.id, "layers": [stage.start, stage.end], "predicted": need.breakdown(),
            "predicted_gib": round(need.total / placement.GiB, 3), "peak_gib": peak,
            "peak_over_predicted": round(peak * placement.GiB / need.total, 3), "marks": marks, "samples": samples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--weights", default="f32,int8,q4")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--context", type=int, default=None, help="driver.max_context (default: the topology's)")
    p.add_argument("--timeline", type=int, default=None, metavar="STAGE_INDEX",
                   help="one stage in process, RSS sampled every 0.2 s (see above)")
    args = p.parse_args()
    if args.timeline is not None:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(timeline(Path(args.model), int(args.stages.split(",")[0]), args.weights.split(",")[0],
                                      args.timeline, args.context, args.requests, Path(tmp))))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(v) for v in args.stages.split(",")):
            for fmt in args.weights.split(","):
                for row in measure(Path(args.model), n, fmt, args.requests, Path(tmp)):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    overheads = sorted(r["overhead_mib"] for r in rows)
    print(json.dumps({"overhead_mib_min": overheads[0], "overhead_mib_median": overheads[len(overheads) // 2],
                      "overhead_mib_max": overheads[-1], "base_mib": placement.OVERHEAD_BASE / placement.MiB,
                      "per_shape_mib": placement.OVERHEAD_PER_SHAPE / placement.MiB,
                      "per_shape_layer_mib": placement.OVERHEAD_PER_SHAPE_LAYER / placement.MiB}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
