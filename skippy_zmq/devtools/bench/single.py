"""The whole model in one process: prefill tok/s, decode tok/s and TTFT, fp32
(or the run's `--dtype`), int8 and q4 weights, on the run's `--device`."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from skippy_zmq.devtools.bench.common import device_label, print_table, synthetic_prompt


def bench_single(model: Path, prompt_tokens: int, new_tokens: int, repeats: int,
                 weights: str = "f32", device: str = "cpu", dtype: str = "float32") -> dict[str, Any]:
    from skippy_zmq.engine.generate import LocalEngine

    engine = LocalEngine(model, dtype=dtype, device=device, weights=weights)
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


def run_single(args: argparse.Namespace, tables: list[str], result: dict[str, Any]) -> dict[str, Any]:
    repeats = 1 if args.quick else args.repeats
    on = {"device": args.device, "dtype": args.dtype}
    single = bench_single(Path(args.model), args.prompt_tokens, args.new_tokens, repeats, **on)
    rows = [single]
    for weights in ("int8", "q4"):
        result[f"single_{weights}"] = bench_single(Path(args.model), args.prompt_tokens, args.new_tokens, repeats,
                                                   weights=weights, **on)
        rows.append(result[f"single_{weights}"])
    tables.append(print_table(f"single process ({device_label(args)}, {single['prompt_tokens']}-token prompt, "
                              f"{single['new_tokens']} new tokens, greedy)", rows))
    return single
