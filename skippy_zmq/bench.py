"""Benchmarks: print a table, write JSON. Speed is measured here, never in tests."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from skippy_zmq.generate import LocalEngine

FILLER = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
          "Numbers like 12345 and names like Ada Lovelace appear in this benchmark text. ")


def synthetic_prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    """Exactly n_tokens ids of ordinary English text."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids.extend(tokenizer.encode(FILLER, add_bos=False))
    return ids[:n_tokens]


def machine() -> dict[str, Any]:
    import os

    import jax

    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def bench_single(model: Path, prompt_tokens: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    engine = LocalEngine(model)
    t0 = time.perf_counter()
    engine.warmup()
    warm_s = time.perf_counter() - t0
    ids = synthetic_prompt(engine.tokenizer, prompt_tokens)
    engine.generate(ids, max_tokens=4, ignore_eos=True)   # compile the attention buckets this length needs
    runs = [engine.generate(ids, max_tokens=new_tokens, ignore_eos=True) for _ in range(repeats)]
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats,
            "warmup_s": round(warm_s, 2),
            "prefill_tok_s": round(statistics.median(r.prefill_tokens_per_s for r in runs), 1),
            "decode_tok_s": round(statistics.median(r.decode_tokens_per_s for r in runs), 1),
            "ttft_ms": round(1000 * statistics.median(r.ttft_s for r in runs), 1)}


def print_table(title: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = [f"### {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    return text


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    repeats = 1 if args.quick else args.repeats
    result: dict[str, Any] = {"machine": machine()}
    tables = []
    if args.suite in ("single", "all"):
        single = bench_single(Path(args.model), args.prompt_tokens, args.new_tokens, repeats)
        result["single"] = single
        tables.append(print_table("single process (fp32, CPU)", [single]))
    if args.suite in ("pipeline", "all"):
        from skippy_zmq.bench_pipeline import bench_pipeline

        result["pipeline"] = bench_pipeline(args, tables)
    if args.suite in ("prefix", "all"):
        from skippy_zmq.bench_prefix import bench_prefix

        result["prefix"] = bench_prefix(args, tables)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text("\n".join(tables))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0
