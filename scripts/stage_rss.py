#!/usr/bin/env python3
"""Measure stage processes' resident memory against skippy_zmq/placement.py's prediction.

For each stage count and weights format: start real stage processes (harness.running_pipeline,
prefix cache off so the cache term is 0), run a few greedy requests, read every stage's VmRSS
from /proc, and print RSS now and at its peak (VmHWM: the load, compiles and requests included), the
predicted weight and KV bytes, the runtime overhead this implies (peak - weights - KV) and RSS and peak
over the predicted total. placement.OVERHEAD_BASE and OVERHEAD_PER_LAYER come from this script.

    .venv/bin/python scripts/stage_rss.py --stages 1,2,3 --weights f32,int8,q4 --requests 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippy_zmq import placement  # noqa: E402
from skippy_zmq.config import ModelConfig  # noqa: E402
from skippy_zmq.driver.engine import GenRequest  # noqa: E402
from skippy_zmq.harness import running_pipeline, write_topology  # noqa: E402
from skippy_zmq.model.checkpoint import stored_weights  # noqa: E402
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--weights", default="f32,int8,q4")
    p.add_argument("--requests", type=int, default=4)
    args = p.parse_args()
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
                      "per_layer_mib": placement.OVERHEAD_PER_LAYER / placement.MiB}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
