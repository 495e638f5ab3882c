"""The suite's CPU by test file, from a run with SKIPPY_CPU_PROFILE=<folder> (tests/cpu_profiling.py).

    python scripts/cpu_profile_table.py <folder> [--top 20]

CPU s of a file = the pytest worker's own CPU in its tests (setup, call, teardown) + the children it
reaped meanwhile; a session fixture's processes (the shared pipelines) count at the worker's last
test's teardown, so that test's row is shown apart ("last on gwN"). Starts = the processes started while
the file's tests ran, by kind: stage, driver (up/driver), worker (cluster worker), compile child
(model.behind), other Python (bench, convert, keys, scripts), and programs (llama-server, g++, ...)."""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path


def kind(argv: list[str]) -> str:
    words = " ".join(argv)
    for key, name in (("skippy_zmq.model.behind", "behind"), (" stage ", "stage"), (" worker", "worker"),
                      (" driver ", "driver"), (" up ", "driver"), ("sys.stdin.readline", "pytest worker")):
        if key in f" {words} ":
            return name
    return "python"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    cpu: dict[str, float] = defaultdict(float)
    wall_tests: Counter = Counter()
    for f in args.folder.glob("cpu-*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            file = r["test"].split("::", 1)[0]
            key = f"{file} (last on {r['worker']}: session teardown)" if r["last"] else file
            cpu[key] += r["self_s"] + r["children_s"]
            wall_tests[file] += 1
    for f in args.folder.glob("cpu-*.json"):   # the first version of the plugin: one file at the end
        data = json.loads(f.read_text())
        for nodeid, r in data["tests"].items():
            file = nodeid.split("::", 1)[0]
            key = f"{file} (last on {data['worker']}: session teardown)" if r["last"] else file
            cpu[key] += r["self_s"] + r["children_s"]
            wall_tests[file] += 1
    starts: dict[str, Counter] = defaultdict(Counter)
    for f in args.folder.glob("procs-*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            file = r["test"].split("::", 1)[0] if r["test"] else "(outside a test)"
            if r["event"] == "start":
                starts[file][kind(r["argv"])] += 1
            elif r["event"] == "exec":
                starts[file][r["program"]] += 1
    total = sum(cpu.values())
    print(f"| file | tests | CPU s | starts |\n|---|---|---|---|")
    for file, s in sorted(cpu.items(), key=lambda kv: -kv[1])[:args.top]:
        base = file.split(" ", 1)[0]
        text = ", ".join(f"{k} {n}" for k, n in starts.get(base, Counter()).most_common()) if base == file else ""
        print(f"| {file.removeprefix('tests/')} | {wall_tests[base]} | {s:.1f} | {text} |")
    every = Counter()
    for c in starts.values():
        every.update(c)
    print(f"\nall files: {total:.1f} CPU s; starts: " + ", ".join(f"{k} {n}" for k, n in every.most_common()))


if __name__ == "__main__":
    main()
