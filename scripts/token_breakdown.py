#!/usr/bin/env python3
"""Where one stream's token goes on 1, 2 and 3 stages of this machine: each stage's compute and own
software, the hops between stages, and the round from the last stage through the driver back to the
first (the stages' per-hop traces, as `bench cluster` reads them).

    .venv/bin/python scripts/token_breakdown.py [--model models/smollm2-135m-instruct] [--stages 1,2,3]

Each stage count: a real pipeline on this machine (stages warm: every idle warm-up done), four greedy
requests of 64 new tokens after 64-token prompts, speculation off; the first request and each
request's first tokens are left out of the medians. Columns, medians in ms: the interval between
tokens as the reader sees them; per stage `compute` (the runner's call, trace `compute_ms`) and `own`
(receive to send less compute: decoding the message, bookkeeping, sampling's Python, encoding);
`hops` (one stage's send to the next one's receive); `round` (the last stage's send to the first
stage's receive of the next step: two hops and the driver's turn). Prints a table, writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy_zmq.devtools.bench.pipeline import TraceLog, hop_medians  # noqa: E402
from skippy_zmq.devtools.harness import running_pipeline, write_topology  # noqa: E402
from skippy_zmq.engine.request import GenRequest  # noqa: E402


def breakdown(steps: list[list[dict]], intervals: list[float]) -> dict:
    """Medians (ms) from the traces of one-row steps in the order they ran (bench.pipeline.hop_medians,
    as `bench cluster` reads them), keyed by stage, and of the reader's intervals between tokens (ms)."""
    ids = [h["stage"] for h in steps[0]] if steps else []
    hops = hop_medians(steps, ids)
    if hops is None:
        raise SystemExit("no decode step's trace crossed the stages with its times: nothing to break down")
    return {"interval": statistics.median(intervals), "compute": dict(zip(ids, hops["compute"])),
            "own": dict(zip(ids, hops["own"])), "hops": hops["transit"], "round": hops["round"]}


def measure(model: Path, n_stages: int, requests: int = 4, new_tokens: int = 64) -> dict:
    if requests < 2:
        raise ValueError(f"requests={requests}: at least 2 (the first only warms the path)")
    with tempfile.TemporaryDirectory(prefix="token-breakdown-") as tmp:
        topology = write_topology(Path(tmp), model, n_stages, name=f"breakdown{n_stages}")
        with running_pipeline(topology, Path(tmp) / "run", timeout=300, warm=True) as (engine, _tok, _topo, _procs):
            log = TraceLog()
            engine.on_reply_hooks.append(log)
            intervals: list[float] = []
            for r in range(requests):
                prompt = tuple(range(1000 + 97 * r, 1064 + 97 * r))
                last = None
                if r == 1:
                    t0 = time.perf_counter()   # the first request only warms the path
                req = GenRequest(uuid.uuid4().hex, prompt, max_tokens=new_tokens, ignore_eos=True, speculative=False)
                for i, _event in enumerate(engine.generate_blocking(req)):
                    now = time.perf_counter()
                    if last is not None and i > 2 and r > 0:
                        intervals.append(1000 * (now - last))
                    last = now
            steps = log.window(t0, time.perf_counter(), steps_only=True)
    return {"stages": n_stages, **breakdown(steps, intervals)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = [measure(args.model, int(n)) for n in args.stages.split(",")]
    print("| stages | token interval | compute (per stage) | own (per stage) | hops | round via the driver |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        def per(d: dict) -> str:
            return " + ".join(f"{v:.2f}" for v in d.values()) + (f" = {sum(d.values()):.2f}" if len(d) > 1 else "")
        hops = " + ".join(f"{h:.2f}" for h in r["hops"]) or "-"
        print(f"| {r['stages']} | {r['interval']:.2f} | {per(r['compute'])} | {per(r['own'])} | {hops} | "
              f"{r['round']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
