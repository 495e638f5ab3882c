"""fp32 vs int8 weights, side by side in one run: decode and prefill speed,
greedy agreement with transformers' fp32 tokens. Prints a table and writes
bench-out/quant.json.

    python -m skippy_zmq.devtools.bench.quant [--model DIR] [--repeats 3] [--xla]

Variants run interleaved (one repeat of each in turn) so load from other
processes on a shared machine hits them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import jax

from skippy_zmq.devtools.bench.common import machine, print_table, synthetic_prompt
from skippy_zmq.engine.generate import LocalEngine
from skippy_zmq.model.quant import QTensor

REPO = Path(__file__).resolve().parents[3]
DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"
DEFAULT_PARITY = REPO.parent / "shared" / "parity" / "smollm2_reference.json"
LLAMA_CPP_TOK_S = 93.0   # llama.cpp Q4_1 single-stream decode on this machine (issue "performance work")


def make_engine(model: Path, variant: str) -> LocalEngine:
    """"f32", "int8" (native CPU kernel) or "int8-xla" (the pure-XLA fallback)."""
    engine = LocalEngine(model, weights="f32" if variant == "f32" else "int8")
    if variant == "int8-xla":
        as_xla = lambda t: dataclasses.replace(t, impl="xla") if isinstance(t, QTensor) else t
        engine.runner.params = jax.tree.map(as_xla, engine.runner.params,
                                            is_leaf=lambda t: isinstance(t, QTensor))
    return engine


def weight_bytes(params: Any) -> int:
    leaves = jax.tree.leaves(params, is_leaf=lambda t: isinstance(t, QTensor))
    return sum(t.nbytes for t in leaves)


def agreement(engine: LocalEngine, parity: dict) -> list[int]:
    """Per parity prompt: greedy tokens generated before the first mismatch with transformers."""
    counts = []
    for case in parity["prompts"]:
        want = case["transformers_fp32_ids"]
        got = engine.generate(case["prompt_ids"], max_tokens=len(want), ignore_eos=True).token_ids
        counts.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want)))
    return counts


def bench_quant(model: Path, parity_path: Path, variants: list[str], prompt_tokens: int,
                new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    parity = json.loads(parity_path.read_text()) if parity_path.is_file() else None
    engines, rows = {}, {}
    for v in variants:
        t0 = time.perf_counter()
        engines[v] = make_engine(model, v)
        load_s = time.perf_counter() - t0
        engines[v].warmup()
        ids = synthetic_prompt(engines[v].tokenizer, prompt_tokens)   # same tokenizer for every variant
        engines[v].generate(ids, max_tokens=4, ignore_eos=True)   # compile this length's attention bucket
        rows[v] = {"weights": v, "weight_mb": round(weight_bytes(engines[v].runner.params) / 1e6),
                   "load_s": round(load_s, 1), "runs": []}
    for _ in range(repeats):
        for v in variants:
            rows[v]["runs"].append(engines[v].generate(ids, max_tokens=new_tokens, ignore_eos=True))
    out = []
    for v in variants:
        runs = rows[v].pop("runs")
        decode = statistics.median(r.decode_tokens_per_s for r in runs)
        row = dict(rows[v], decode_tok_s=round(decode, 1),
                   prefill_tok_s=round(statistics.median(r.prefill_tokens_per_s for r in runs), 1),
                   vs_llama_cpp=round(decode / LLAMA_CPP_TOK_S, 2))
        if parity:
            counts = agreement(engines[v], parity)
            total = sum(len(c["transformers_fp32_ids"]) for c in parity["prompts"])
            row.update(agree=f"{sum(counts)}/{total}", agree_per_prompt=counts)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--parity", default=str(DEFAULT_PARITY))
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--xla", action="store_true", help="also run the pure-XLA int8 fallback (slow)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    variants = ["f32", "int8"] + (["int8-xla"] if args.xla else [])
    load_before = os.getloadavg()[0]
    rows = bench_quant(Path(args.model), Path(args.parity), variants, args.prompt_tokens,
                       args.new_tokens, args.repeats)
    title = (f"fp32 vs int8 weights ({args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
             f"median of {args.repeats}; llama.cpp Q4_1 = {LLAMA_CPP_TOK_S} tok/s)")
    print_table(title, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": dict(machine(), loadavg_1m_before=load_before, loadavg_1m_after=os.getloadavg()[0]),
              "settings": vars(args), "rows": rows}
    (out / "quant.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'quant.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
