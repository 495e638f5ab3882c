#!/usr/bin/env python3
"""Run-on against a driver round per token, taking turns in one run: two servers of `--stages` stages
(1: the stage runs on itself; more: the ring, last stage to first) on the same checkpoint,
`driver.run_on` 0 and 8, one streamed greedy request at a time, alternating.

    .venv/bin/python scripts/ab_run_on.py --model models/smollm2-135m-instruct --rounds 6
    SKIPPY_KERNEL_ISA=avx512vnni .venv/bin/python scripts/ab_run_on.py --model <Q4_K_M checkpoint> \\
        --speculative --copy --out bench-out/run-on.json

Each round streams `--tokens` new tokens after a 512-token prompt from each server (speculation off
unless `--speculative`; `--copy`: a prompt that repeats itself, so the drafter finds long copies).
A whole `bench peers` run moves by 10-20% between runs on a shared 2-core VM; two servers up at
once, taking turns request by request, see the same machine. Prints each round and the medians'
ratio; writes them as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@contextmanager
def server(model: Path, run_on: int, run_dir: Path, weights: str, stages: int) -> Iterator[str]:
    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.devtools.harness import write_topology
    from skippy_zmq.devtools.soak import wait_warmed
    from skippy_zmq.ops.launch import spawn_driver, spawn_stages, stop_processes, wait_http_ready

    run_dir.mkdir(parents=True, exist_ok=True)
    path = write_topology(run_dir, model.absolute(), stages, name=f"run-on-{run_on}", weights=weights, kv_lanes=2,
                          driver__max_sessions=2, driver__max_context=2048, driver__run_on=run_on,
                          driver__speculative={"method": "ngram"})
    topology = load_topology(path)
    procs = spawn_stages(topology, path, run_dir)
    try:
        procs.append(spawn_driver(path, run_dir))
        url = f"http://{topology.driver.http_host}:{topology.driver.http_port}"
        wait_http_ready(url, procs, run_dir, 600)
        wait_warmed(url + "/v1", 600)
        yield url + "/v1"
    finally:
        stop_processes(procs)


def main() -> int:
    from skippy_zmq.devtools.bench.peers_client import stream_completion

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    ap.add_argument("--weights", default="auto", help="the stages' `weights` (auto: the checkpoint's own)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--speculative", action="store_true", help="requests ask for speculation (ngram)")
    ap.add_argument("--copy", action="store_true", help="a prompt that repeats itself")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    prompt = [(i * 7919) % 40000 + 100 for i in range(100 if args.copy else 512)]
    prompt = (prompt * 6)[:512]
    extra = {"speculative": args.speculative}
    got: dict[int, list[float]] = {0: [], 8: []}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="ab-run-on-") as tmp:
        urls = {k: stack.enter_context(server(args.model, k, Path(tmp) / str(k), args.weights, args.stages)) for k in got}
        for url in urls.values():
            stream_completion(url, prompt, 16, extra)
        print("| round | run_on 0 tok/s | run_on 8 tok/s |\n|---|---|---|")
        for r in range(args.rounds):
            for k, url in urls.items():
                got[k].append(stream_completion(url, prompt, args.tokens, extra).decode_tok_s)
            print(f"| {r} | {got[0][-1]:.1f} | {got[8][-1]:.1f} |", flush=True)
    median = {k: statistics.median(v) for k, v in got.items()}
    ratio = median[8] / median[0]
    faster = sum(b > a for a, b in zip(got[0], got[8]))
    print(f"| median | {median[0]:.1f} | {median[8]:.1f} |\nrun_on 8 / 0: {ratio:.3f}; faster in "
          f"{faster} of {args.rounds} rounds")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "tok_s": got,
                                        "median": median, "ratio": ratio, "faster_rounds": faster}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
