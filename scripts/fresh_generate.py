#!/usr/bin/env python3
"""Speculation in a fresh `skippy-zmq generate --weights q4` process, the way a user meets it: each run
is a new process (its warm-up, reported apart as warmup_s, runs before the clock), alternating
`--speculative off` and `ngram` on one copy prompt of `bench spec`, greedy, the same tokens asserted.

    .venv/bin/python scripts/fresh_generate.py --pairs 3 --out /tmp/fresh_generate.json

Prints a Markdown table (one row per run, then the median ratio); writes the runs as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippy_zmq.devtools.bench.spec_workloads import copy_messages  # noqa: E402


def run(model: str, prompt: str, mode: str, max_tokens: int) -> dict:
    cli = Path(sys.executable).parent / "skippy-zmq"
    out = subprocess.run([str(cli), "generate", "--model", model, "--weights", "q4", "--chat", "--json",
                          "--speculative", mode, "--max-tokens", str(max_tokens), prompt],
                         capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--prompt", type=int, default=6, help="index into bench spec's copy prompts")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    prompt = copy_messages()[args.prompt]
    rows, ratios = [], []
    for pair in range(args.pairs):
        got = {mode: run(args.model, prompt, mode, args.max_tokens) for mode in ("off", "ngram")}
        if got["off"]["text"] != got["ngram"]["text"]:
            raise SystemExit(f"pair {pair}: speculation changed the greedy text")
        for mode, r in got.items():
            spec = r.get("speculative") or {}
            rows.append({"pair": pair, "speculative": mode, "decode_tok_s": round(r["decode_tokens_per_s"], 1),
                         "warmup_s": round(r["warmup_s"], 2), "windows": spec.get("windows", 0),
                         "acceptance": spec.get("acceptance", "")})
        ratios.append(got["ngram"]["decode_tokens_per_s"] / got["off"]["decode_tokens_per_s"])
        print(f"[fresh_generate] pair {pair}: {rows[-2]} {rows[-1]}", file=sys.stderr, flush=True)
    print("| pair | speculative | decode tok/s | warm-up s (before the clock) | windows | acceptance |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['speculative']} | {r['decode_tok_s']} | {r['warmup_s']} | {r['windows']} | "
              f"{r['acceptance']} |")
    print(f"\nngram ÷ off per pair: {', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "ratios": ratios, "median": statistics.median(ratios)},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
