#!/usr/bin/env python3
"""`bench peers --quick` at an earlier commit and at this checkout, taking turns, as one table.

    .venv/bin/python scripts/peers_ab.py --before 7e0aee8 --runs 2 --out bench-out/peers-ab
    # only the table, from runs already made (folders with a bench.json each):
    .venv/bin/python scripts/peers_ab.py --table before-1 after-1 before-2 after-2

Issue 39 asks that the reorganised code give the same `bench peers` figures as the code before it.
One run of each says little on a shared 2-core machine: llama-server's own rows, the same binary,
move by 10-20% between runs. So the two codes take turns (before, after, before, after, ...), each
run is a whole `bench peers --quick --peer-models smollm2` (its own stages, its own llama-server),
and the table gives every row of ours per run, after ÷ before of the medians, and llama-server's
rows of the same runs as the yardstick of the noise.

The earlier commit runs from a `git worktree` (removed afterwards) on this checkout's virtualenv,
with PYTHONPATH at the worktree (its stages inherit it), on a checkpoint its own `convert` makes
from the same GGUF, since the checkpoint format may have changed in between. Its dependencies are
this checkout's: pick a commit whose setup.cfg pins the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2-135m-instruct"


def our_rows(peers: dict) -> dict[str, float]:
    """Row name -> figure of a `bench peers` JSON's "peers" section; llama-server's rows in parentheses."""
    out: dict[str, float] = {}
    for r in peers.get("single", []):
        if r["engine"].startswith("skippy"):
            out["single stream decode tok/s"] = r["decode_tok_s"]
            out["single stream prefill tok/s"] = r["prefill_tok_s"]
        elif r["engine"] == "llama-server":
            out["(llama-server single stream decode)"] = r["decode_tok_s"]
    for r in peers.get("speculation", []):
        if r["engine"].startswith("skippy"):
            out[f"speculation {r['workload']} off"] = r["off_tok_s"]
            out[f"speculation {r['workload']} on"] = r["on_tok_s"]
    for r in peers.get("concurrency", []):
        if r["engine"].startswith("skippy"):
            out[f"{r['streams']} stream(s), {r['engine'].split(', ', 1)[1]}"] = r["agg_tok_s"]
        else:
            out[f"({r['engine']}, {r['streams']} stream(s))"] = r["agg_tok_s"]
    for r in peers.get("rpc", []):
        out[f"{r['stages']} stages, {r['hop_ms']:g} ms per hop"] = r["ours_tok_s"]
    return out


def table(runs: dict[str, dict[str, float]]) -> tuple[str, dict[str, float]]:
    """Markdown of every row per run (names with "before" / "after" in them) and after ÷ before of the
    medians; also returns those ratios."""
    before = [n for n in runs if "before" in n]
    after = [n for n in runs if "after" in n]
    if not before or not after:
        raise SystemExit("runs named with 'before' and with 'after' are needed")
    names = [k for k in runs[before[0]] if all(k in rows for rows in runs.values())]
    ratios = {k: statistics.median(runs[n][k] for n in after) / statistics.median(runs[n][k] for n in before)
              for k in names}
    lines = ["| row | " + " | ".join(runs) + " | after ÷ before |", "|---" * (len(runs) + 2) + "|"]
    lines += [f"| {k} | " + " | ".join(f"{runs[n][k]:g}" for n in runs) + f" | {ratios[k]:.3f} |" for k in names]
    return "\n".join(lines), ratios


def bench(cwd: Path, out: Path, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "skippy_zmq.cli", "bench", "peers", "--quick", "--peer-models", "smollm2",
           "--out", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="the earlier commit")
    ap.add_argument("--runs", type=int, default=2, help="runs of each code, taking turns")
    ap.add_argument("--out", type=Path, default=Path("bench-out/peers-ab"))
    ap.add_argument("--table", nargs="+", type=Path, help="folders of earlier runs: print their table only")
    args = ap.parse_args(argv)
    if args.table:
        runs = {p.name: our_rows(json.loads((p / "bench.json").read_text())["peers"]) for p in args.table}
        print(table(runs)[0])
        return 0
    if not args.before:
        ap.error("--before COMMIT (or --table FOLDERS)")
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = ROOT / "models" / GGUF
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run `make model` first")
    with tempfile.TemporaryDirectory(prefix="peers-ab-") as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.before], check=True)
        try:
            old_env = {**os.environ, "PYTHONPATH": str(tree)}
            (tree / "models").mkdir()
            (tree / "models" / GGUF).symlink_to(gguf)
            subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "convert", "--gguf", f"models/{GGUF}", "--out",
                            f"models/{MODEL}"], cwd=tree, env=old_env, check=True)
            names = []
            for i in range(1, args.runs + 1):
                for name, cwd, env in ((f"before-{i}", tree, old_env), (f"after-{i}", ROOT, dict(os.environ))):
                    print(f"[peers-ab] {name}", flush=True)
                    bench(cwd, (args.out / name).absolute(), env)
                    names.append(name)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    runs = {n: our_rows(json.loads((args.out / n / "bench.json").read_text())["peers"]) for n in names}
    text, ratios = table(runs)
    print(text)
    (args.out / "peers_ab.json").write_text(json.dumps({"before": args.before, "runs": runs, "after_over_before": ratios},
                                                       indent=2) + "\n")
    (args.out / "peers_ab.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
