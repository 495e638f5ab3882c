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

from skippy_zmq.devtools.harness import running_pipeline, write_topology  # noqa: E402
from skippy_zmq.engine.request import GenRequest  # noqa: E402


def breakdown(steps: list[list[dict]], intervals: list[float]) -> dict:
    """Medians (ms) from the traces of one-row steps (one entry per stage, each with recv_ns, send_ns
    and compute_ms) in the order they ran, and the reader's intervals between tokens (ms)."""
    med = statistics.median
    n = len(steps[0])
    ids = [h["stage"] for h in steps[0]]
    rounds = [(b[0]["recv_ns"] - a[-1]["send_ns"]) / 1e6 for a, b in zip(steps, steps[1:])
              if b[0]["recv_ns"] > a[-1]["send_ns"]]
    return {"interval": med(intervals),
            "compute": {s: med(float(t[i]["compute_ms"]) for t in steps) for i, s in enumerate(ids)},
            "own": {s: med((t[i]["send_ns"] - t[i]["recv_ns"]) / 1e6 - float(t[i]["compute_ms"]) for t in steps)
                    for i, s in enumerate(ids)},
            "hops": [med((t[i + 1]["recv_ns"] - t[i]["send_ns"]) / 1e6 for t in steps) for i in range(n - 1)],
            "round": med(rounds) if rounds else None}


def measure(model: Path, n_stages: int, requests: int = 4, new_tokens: int = 64) -> dict:
    with tempfile.TemporaryDirectory(prefix="token-breakdown-") as tmp:
        topology = write_topology(Path(tmp), model, n_stages, name=f"breakdown{n_stages}")
        with running_pipeline(topology, Path(tmp) / "run", timeout=300, warm=True) as (engine, _tok, _topo, _procs):
            traces: list[list[dict]] = []

            def hook(_stage_id: str, m) -> None:
                trace = m.extras.get("trace") or (m.extras.get("stats") or {}).get("trace")
                if m.kind.name == "PREDICTED_TOKENS" and trace:
                    traces.append(trace)
            engine.on_reply_hooks.append(hook)
            intervals: list[float] = []
            for r in range(requests):
                prompt = tuple(range(1000 + 97 * r, 1064 + 97 * r))
                last = None
                if r == 1:
                    traces.clear()
                req = GenRequest(uuid.uuid4().hex, prompt, max_tokens=new_tokens, ignore_eos=True, speculative=False)
                for i, _event in enumerate(engine.generate_blocking(req)):
                    now = time.perf_counter()
                    if last is not None and i > 2 and r > 0:
                        intervals.append(1000 * (now - last))
                    last = now
    steps = [t for t in traces if len(t) == n_stages and all("recv_ns" in h and "send_ns" in h for h in t)
             and all(h.get("rows", 1) == 1 for h in t)]
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
