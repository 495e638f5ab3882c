"""Benchmarks: print Markdown tables, write bench.json + bench.md + PNG plots.

Speed is measured here, never in tests. Suites (`skippy-zmq bench SUITE`):

- single    the whole model in one process: prefill tok/s, decode tok/s, TTFT
- peers     llama.cpp (llama-cpp-python) on the same GGUF, same prompt, same run
- pipeline  1/2/3 stage processes: decode tok/s, per-hop overhead, wire bytes,
            concurrency sweep with inter-token latency and pipeline bubble
- hops      a simulated per-hop delay against the hop-count model
- prefix    prefix cache: TTFT cold vs warm, cost at 0% hits
- all       every suite above, in that order (later suites reuse earlier numbers)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

SUITES = ("single", "peers", "pipeline", "hops", "prefix")

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
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg_1m": round(os.getloadavg()[0], 2)}


def bench_single(model: Path, prompt_tokens: int, new_tokens: int, repeats: int,
                 weights: str = "f32") -> dict[str, Any]:
    from skippy_zmq.generate import LocalEngine

    engine = LocalEngine(model, weights=weights)
    t0 = time.perf_counter()
    engine.warmup()
    warm_s = time.perf_counter() - t0
    ids = synthetic_prompt(engine.tokenizer, prompt_tokens)
    engine.generate(ids, max_tokens=4, ignore_eos=True)   # compile the attention buckets this length needs
    runs = [engine.generate(ids, max_tokens=new_tokens, ignore_eos=True) for _ in range(repeats)]
    return {"weights": weights, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats,
            "warmup_s": round(warm_s, 2),
            "prefill_tok_s": round(statistics.median(r.prefill_tokens_per_s for r in runs), 1),
            "decode_tok_s": round(statistics.median(r.decode_tokens_per_s for r in runs), 1),
            "ttft_ms": round(1000 * statistics.median(r.ttft_s for r in runs), 1)}


def format_table(title: str, rows: list[dict[str, Any]], note: str = "") -> str:
    """A Markdown table (columns = the first row's keys), with an optional note under it."""
    if not rows:
        return ""
    keys = list(rows[0])
    lines = [f"### {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    return str(value).replace("|", "\\|")


def print_table(title: str, rows: list[dict[str, Any]], note: str = "") -> str:
    text = format_table(title, rows, note)
    if text:
        print(text, flush=True)
    return text


def run_single(args: argparse.Namespace, tables: list[str], result: dict[str, Any]) -> dict[str, Any]:
    repeats = 1 if args.quick else args.repeats
    single = bench_single(Path(args.model), args.prompt_tokens, args.new_tokens, repeats)
    int8 = bench_single(Path(args.model), args.prompt_tokens, args.new_tokens, repeats, weights="int8")
    result["single_int8"] = int8
    tables.append(print_table(f"single process (JAX on CPU, {single['prompt_tokens']}-token prompt, "
                              f"{single['new_tokens']} new tokens, greedy)", [single, int8]))
    return single


def suite_runners() -> dict[str, Callable[[argparse.Namespace, list[str], dict[str, Any]], Any]]:
    from skippy_zmq.bench_hops import bench_hops
    from skippy_zmq.bench_peers import bench_peers
    from skippy_zmq.bench_pipeline import bench_pipeline
    from skippy_zmq.bench_prefix import bench_prefix

    return {"single": run_single, "peers": bench_peers, "pipeline": bench_pipeline, "hops": bench_hops,
            "prefix": lambda args, tables, _result: bench_prefix(args, tables)}


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suites = SUITES if args.suite == "all" else (args.suite,)
    result: dict[str, Any] = {"machine": {**machine(), "quick": bool(args.quick)}, "elapsed_s": {}}
    tables: list[str] = []
    runners = suite_runners()
    for name in suites:
        t0 = time.perf_counter()
        result[name] = runners[name](args, tables, result)
        result["elapsed_s"][name] = round(time.perf_counter() - t0, 1)
        print(f"[bench] {name} took {result['elapsed_s'][name]:.0f} s", flush=True)
    from skippy_zmq.bench_plots import write_plots

    plots = write_plots(result, out)
    result["plots"] = [p.name for p in plots]
    header = (f"# skippy_zmq benchmarks\n\n{result['machine']['date']} on {result['machine']['host']} "
              f"({result['machine']['cores']} cores, {result['machine']['backend']}, jax "
              f"{result['machine']['jax']}, load average {result['machine']['load_avg_1m']} at the start)"
              f"{' — quick run' if args.quick else ''}\n")
    images = "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text(header + "\n" + "\n".join(t for t in tables if t) + images)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}" +
          (f"; plots: {', '.join(str(p) for p in plots)}" if plots else ""))
    return 0
