"""Pipeline benchmarks: 1/2/3 stages side by side with the single process.

Real stage processes on loopback, the driver's PipelineEngine in this
process. Reports decode tok/s per stream count and ratios to the single
process measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from skippy_zmq.driver.engine import GenRequest
from skippy_zmq.launch import running_pipeline, write_topology

LLAMA_CPP_DECODE_TOK_S = 93.0   # single-stream llama.cpp on this machine (issue text)


def run_stream(engine: Any, ids: list[int], new_tokens: int, out: list[dict[str, float]]) -> None:
    stamps = []
    t0 = time.perf_counter()
    for event in engine.generate_blocking(GenRequest("bench", tuple(ids), max_tokens=new_tokens, ignore_eos=True)):
        if event.token_id is not None:
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    out.append({"ttft_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0], "tokens": len(stamps),
                "gaps": gaps})


def measure(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Run len(prompts) concurrent streams; aggregate decode tok/s and inter-token latency."""
    results: list[dict[str, Any]] = []
    threads = [threading.Thread(target=run_stream, args=(engine, p, new_tokens, results)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gaps = sorted(g for r in results for g in r["gaps"])
    decode_tokens = sum(r["tokens"] - 1 for r in results)
    decode_window = max(r["decode_s"] for r in results)
    return {"streams": len(prompts), "agg_tok_s": round(decode_tokens / decode_window, 1),
            "per_stream_tok_s": round(statistics.median((r["tokens"] - 1) / r["decode_s"] for r in results), 1),
            "itl_p50_ms": round(1000 * gaps[len(gaps) // 2], 1),
            "itl_p99_ms": round(1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))], 1),
            "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in results), 1),
            "wall_s": round(wall, 2)}


def bench_pipeline(args: argparse.Namespace, tables: list[str]) -> dict[str, Any]:
    from skippy_zmq.bench import bench_single, print_table, synthetic_prompt

    stage_counts = (1, 2) if args.quick else (1, 2, 3)
    streams = (1, 2, 4, 8) if not args.quick else (1, 8)
    new_tokens = 32 if args.quick else 64
    prompt_len = 64
    single = bench_single(Path(args.model), prompt_len, new_tokens, 1 if args.quick else 3)
    rows, result = [], {"single": single, "topologies": {}}
    tmp = Path(tempfile.mkdtemp(prefix="skippy-bench-"))
    for n in stage_counts:
        path = write_topology(tmp, Path(args.model).absolute(), n, name=f"bench-{n}", kv_lanes=8,
                              driver__max_sessions=8)
        with running_pipeline(path, tmp / f"run-{n}") as (engine, tokenizer, _, _procs):
            base = synthetic_prompt(tokenizer, prompt_len)
            measure(engine, [base], 8)      # compile buckets outside the timed runs
            measure(engine, [base] * max(streams), 8)
            for s in streams:
                prompts = [[(t + i) % 1000 + 200 for t in base] if i else base for i in range(s)]
                m = measure(engine, prompts, new_tokens)
                m.update(stages=n, ratio_to_single=round(m["per_stream_tok_s"] / single["decode_tok_s"], 3),
                         ratio_to_llama_cpp=round(m["agg_tok_s"] / LLAMA_CPP_DECODE_TOK_S, 3))
                rows.append(m)
        result["topologies"][n] = [r for r in rows if r["stages"] == n]
    keys = ["stages", "streams", "agg_tok_s", "per_stream_tok_s", "ratio_to_single", "ratio_to_llama_cpp",
            "itl_p50_ms", "itl_p99_ms", "ttft_ms"]
    tables.append(print_table(f"pipeline decode (single process: {single['decode_tok_s']} tok/s, "
                              f"{new_tokens} new tokens, {prompt_len}-token prompts)",
                              [{k: r[k] for k in keys} for r in rows]))
    result["rows"] = rows
    return result
