#!/usr/bin/env python3
"""One-row decode step time against the attention length, with and without the KV arena's spare
slot (skippy_zmq.config.model.KV_SPARE_SLOTS), side by side in one process: on XLA:CPU a step whose
attention length equals the arena's length (every position up to the capacity) ran about 4x slower
than one that reads all but the last position.

    .venv/bin/python scripts/attn_arena.py --out /tmp/attn_arena.json
    .venv/bin/python scripts/attn_arena.py --weights f32 --cases 700:600 2048:100 2048:1500

A case is CAPACITY:POSITION (the row decodes at POSITION, so it attends to the bucket holding
POSITION + 1). Prints a Markdown table; writes the rows as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from skippy_zmq.cli import configure_jax  # noqa: E402


def step_ms(runner, position: int, repeats: int) -> float:
    args = (np.array([0]), np.array([5], np.int32), np.array([position]), np.array([1]), "logits")
    for _ in range(3):   # compile and settle
        runner.step(*args)
    t0 = time.perf_counter()
    for _ in range(repeats):
        runner.step(*args)
    return 1000 * (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--weights", default="q4", help="f32 | bf16 | int8 | q4 (default q4, as bench peers)")
    ap.add_argument("--cases", nargs="+", default=["700:600", "2048:100", "2048:1000", "2048:1500"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    configure_jax()
    from skippy_zmq.engine.generate import LocalEngine
    from skippy_zmq.model import llama

    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases]
    rows = []
    for capacity in sorted({c for c, _ in cases}):
        for spare in (0, 1):
            llama.KV_SPARE_SLOTS = spare   # read when the arena is made (KVCache.create) and sized
            engine = LocalEngine(Path(args.model), capacity=capacity, weights=args.weights)
            runner = engine.runner
            for _, position in [c for c in cases if c[0] == capacity]:
                rows.append({"capacity": capacity, "position": position, "spare_slots": spare,
                             "attn_len": runner.buckets.attn_for(position + 1, capacity),
                             "step_ms": round(step_ms(runner, position, args.repeats), 2)})
                print(f"[attn_arena] {rows[-1]}", file=sys.stderr, flush=True)
            del engine, runner
    print("| capacity | position | attention length | step ms, no spare slot | step ms, spare slot | ratio |")
    print("|---|---|---|---|---|---|")
    for capacity, position in cases:
        got = {r["spare_slots"]: r for r in rows if (r["capacity"], r["position"]) == (capacity, position)}
        print(f"| {capacity} | {position} | {got[1]['attn_len']} | {got[0]['step_ms']} | {got[1]['step_ms']} | "
              f"{got[0]['step_ms'] / got[1]['step_ms']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"weights": args.weights, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
