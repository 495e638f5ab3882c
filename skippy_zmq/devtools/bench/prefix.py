"""Prefix-cache benchmark: TTFT cold vs warm by shared-prefix length, and the
cost of the cache when nothing hits (throughput with the cache on vs off).

Runs the 2-stage pipeline as real processes; both cache settings in one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from skippy_zmq.devtools.bench.common import print_table, stage_overrides, synthetic_prompt
from skippy_zmq.engine.request import GenRequest
from skippy_zmq.devtools.harness import running_pipeline, write_topology

TAIL = 16


def timed(engine: Any, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, total_s, cached_tokens) of one request."""
    t0 = time.perf_counter()
    ttft, cached = 0.0, 0
    for event in engine.generate_blocking(GenRequest("bench", tuple(ids), max_tokens=max_tokens, ignore_eos=True)):
        if event.token_id is not None and not ttft:
            ttft, cached = time.perf_counter() - t0, event.cached_tokens
    return ttft, time.perf_counter() - t0, cached


def distinct(tokenizer: Any, n: int, salt: int) -> list[int]:
    return [(t * 7 + salt * 13) % 20000 + 300 for t in synthetic_prompt(tokenizer, n)]


def ttft_rows(engine: Any, tokenizer: Any, lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for i, n in enumerate(lengths):
        throwaway = distinct(tokenizer, n, salt=3000 + i)       # compile this length's buckets, both paths
        for k in range(2):
            timed(engine, throwaway + distinct(tokenizer, TAIL, salt=k), 1)
        prefix = distinct(tokenizer, n, salt=1000 + i)
        cold, _, _ = timed(engine, prefix + distinct(tokenizer, TAIL, salt=1), 1)
        warm_runs = [timed(engine, prefix + distinct(tokenizer, TAIL, salt=2 + k), 1) for k in range(3)]
        warm = statistics.median(r[0] for r in warm_runs)
        rows.append({"prefix_tokens": n, "tail_tokens": TAIL, "cold_ttft_ms": round(1000 * cold, 1),
                     "warm_ttft_ms": round(1000 * warm, 1), "warm_over_cold": round(warm / cold, 4),
                     "cached_tokens": warm_runs[0][2]})
    return rows


def throughput(engine: Any, tokenizer: Any, n_requests: int, prompt_tokens: int, new_tokens: int) -> float:
    """Requests/s for unique prompts (0% hits), one at a time."""
    t0 = time.perf_counter()
    for i in range(n_requests):
        timed(engine, distinct(tokenizer, prompt_tokens, salt=5000 + i), new_tokens)
    return n_requests / (time.perf_counter() - t0)


def bench_prefix(args: argparse.Namespace, tables: list[str]) -> dict[str, Any]:
    lengths = (256, 1024) if args.quick else (256, 512, 1024, 2048)
    n_req, prompt_tokens, new_tokens = (4, 256, 16) if args.quick else (8, 512, 32)
    tmp = Path(tempfile.mkdtemp(prefix="skippy-bench-prefix-"))
    model = Path(args.model).absolute()
    # dead_after_s: a stage compiling a long prefill bucket on a busy machine must not look dead.
    common = {"driver__max_context": 4096, "driver__dead_after_s": 30.0, **stage_overrides(args)}
    on = write_topology(tmp, model, 2, name="cache-on", **common)
    off = write_topology(tmp, model, 2, name="cache-off", **common, cache={"mode": "disabled"})
    result: dict[str, Any] = {}
    with running_pipeline(on, tmp / "run-on", warm=True) as (engine, tokenizer, _, _):
        timed(engine, distinct(tokenizer, 300, salt=9), 2)     # compile outside the timings
        result["ttft"] = ttft_rows(engine, tokenizer, lengths)
        throughput(engine, tokenizer, 1, prompt_tokens, new_tokens)
        on_rps = throughput(engine, tokenizer, n_req, prompt_tokens, new_tokens)
    with running_pipeline(off, tmp / "run-off", warm=True) as (engine, tokenizer, _, _):
        throughput(engine, tokenizer, 1, prompt_tokens, new_tokens)
        off_rps = throughput(engine, tokenizer, n_req, prompt_tokens, new_tokens)
    result["zero_hit"] = {"requests": n_req, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                          "cache_on_req_s": round(on_rps, 3), "cache_off_req_s": round(off_rps, 3),
                          "overhead": round(1 - on_rps / off_rps, 4)}
    tables.append(print_table("prefix cache: TTFT cold vs warm (2 stages, shared prefix + 16-token tail)",
                              result["ttft"]))
    tables.append(print_table("prefix cache at 0% hits: throughput with the cache on vs off", [result["zero_hit"]]))
    return result
