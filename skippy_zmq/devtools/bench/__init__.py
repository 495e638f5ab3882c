"""Benchmarks: print Markdown tables, write bench.json + bench.md + PNG plots.

Speed is measured here, never in tests. Suites (`skippy-zmq bench SUITE`), one
module each in this package:

- single    the whole model in one process: prefill tok/s, decode tok/s, TTFT
- peers     llama-server (`make peers` builds it) on the same GGUF, through both HTTP APIs: single
            stream, n-gram speculation, 1-32 streams against `-np N`; SmolLM2 (`bench peers`
            alone adds the random 1B and 8B shapes)
- pipeline  1/2/3 stage processes: decode tok/s, per-hop overhead, wire bytes,
            concurrency sweep (1 to 32 streams) with inter-token latency and
            pipeline bubble; off cpu/float32, greedy tokens against the CPU
- hops      a simulated per-hop delay against the hop-count model
- prefix    prefix cache: TTFT cold vs warm, cost at 0% hits
- all       every suite above, in that order (later suites reuse earlier numbers)
- scale     random models of real sizes (Llama-3.2-1B, Llama-3.1-8B shapes, q4) on 1-3 stages and
            llama.cpp on the same weights: not part of `all` (about an hour on 2 cores)
- cluster   three hosts at 100%, 50% and 25% of a core (cgroups; namespaces when allowed): the split
            by measured speed against even, memory-only and grid splits, predicted beside measured;
            not part of `all`
- spec      speculative decoding on SmolLM2: ours off / on (1 stage; 3 stages at 5 and 20 ms per
            hop; 8 streams on 2 stages) beside llama.cpp plain and with prompt lookup, copy and chat
            workloads, acceptance, greedy identity and the issue's goals: not part of `all`

`--device cpu|gpu:N|tpu:N` and `--dtype float32|bfloat16` place every stage
(and the single-process engine); `quant` (fp32 vs int8 weights) runs on its
own: `python -m skippy_zmq.devtools.bench.quant`; `plots` draws the PNGs.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from typing import Any, Callable

from skippy_zmq.devtools.bench.common import machine

ALL_SUITES = ("single", "peers", "pipeline", "hops", "prefix")   # what `bench all` runs
SUITES = ALL_SUITES + ("scale", "spec", "cluster")

Runner = Callable[[argparse.Namespace, list[str], dict[str, Any]], Any]


def suite_runners() -> dict[str, Runner]:
    from skippy_zmq.devtools.bench.cluster import bench_cluster
    from skippy_zmq.devtools.bench.hops import bench_hops
    from skippy_zmq.devtools.bench.peers import bench_peers
    from skippy_zmq.devtools.bench.pipeline import bench_pipeline
    from skippy_zmq.devtools.bench.prefix import bench_prefix
    from skippy_zmq.devtools.bench.scale import bench_scale
    from skippy_zmq.devtools.bench.single import run_single
    from skippy_zmq.devtools.bench.spec import bench_spec

    return {"single": run_single, "peers": bench_peers, "pipeline": bench_pipeline, "hops": bench_hops,
            "prefix": lambda args, tables, _result: bench_prefix(args, tables), "scale": bench_scale,
            "spec": bench_spec, "cluster": bench_cluster}


def _stop_on_term(signum: int, _frame: Any) -> None:
    """SIGTERM unwinds like Ctrl-C: every `with` that started a peer (llama-server, rpc-server,
    stages, relays) stops it; Python's default would exit at once and leave them running."""
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _stop_on_term)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suites = ALL_SUITES if args.suite == "all" else (args.suite,)
    result: dict[str, Any] = {"machine": {**machine(), "device": args.device, "dtype": args.dtype,
                                          "quick": bool(args.quick)}, "elapsed_s": {}}
    tables: list[str] = []
    runners = suite_runners()
    for name in suites:
        t0 = time.perf_counter()
        result[name] = runners[name](args, tables, result)
        result["elapsed_s"][name] = round(time.perf_counter() - t0, 1)
        print(f"[bench] {name} took {result['elapsed_s'][name]:.0f} s", flush=True)
    from skippy_zmq.devtools.bench.goals import goal_rows
    from skippy_zmq.devtools.bench.plots import write_plots

    if args.suite == "all":
        from skippy_zmq.devtools.bench.common import print_table

        result["goals"] = goal_rows(result)
        tables.insert(0, print_table("goals (every figure from this run, side by side)", result["goals"]))

    plots = write_plots(result, out)
    result["plots"] = [p.name for p in plots]
    m = result["machine"]
    header = (f"# skippy_zmq benchmarks\n\n{m['date']} on {m['host']} ({m['cores']} cores, {m['device']} "
              f"{m['dtype']}, jax {m['jax']} ({m['backend']}), load average {m['load_avg_1m']} at the start)"
              f"{' — quick run' if args.quick else ''}\n")
    images = "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(header + "\n" + "\n".join(t for t in tables if t) + images)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}" +
          (f"; plots: {', '.join(str(p) for p in plots)}" if plots else ""))
    return 0
