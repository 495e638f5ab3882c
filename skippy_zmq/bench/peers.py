"""Peers: llama.cpp (through llama-cpp-python) on the same GGUF, in the same run.

Same prompt ids (the GGUF's vocabulary is ours), same lengths, greedy, 2
threads. llama-cpp-python is optional (`make bench-peers` installs the `peers`
extra, a ~10 minute source build); without it the suite says so and skips.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

from skippy_zmq.bench.common import print_table, synthetic_prompt
from skippy_zmq.bench.single import bench_single

NOT_INSTALLED = "not installed (make bench-peers)"


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def find_gguf(model: Path) -> Path | None:
    """The GGUF a converted model came from (source.json), next to or inside the model directory."""
    try:
        name = json.loads((model / "source.json").read_text()).get("file", "")
    except (OSError, ValueError):
        return None
    for candidate in (model / name, model.parent / name):
        if name.endswith(".gguf") and candidate.is_file():
            return candidate
    return None


def ratio(ours: float, theirs: float) -> float | None:
    return round(ours / theirs, 3) if ours and theirs else None


def time_generation(llm: Any, prompt_ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) measured like ours: prefill up to the first token, then the rest."""
    llm.reset()   # no KV reuse from the previous run (generate() would match the common prefix)
    t0 = time.perf_counter()
    t_first, n = 0.0, 0
    for _token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
        n += 1
        if n == 1:
            t_first = time.perf_counter()
        if n >= new_tokens:
            break
    t_end = time.perf_counter()
    return len(prompt_ids) / max(t_first - t0, 1e-9), (n - 1) / max(t_end - t_first, 1e-9)


def run_llama_cpp(gguf: Path, prompt_ids: list[int], new_tokens: int, repeats: int,
                  threads: int = 2) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=len(prompt_ids) + new_tokens + 16, n_batch=512,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    time_generation(llm, prompt_ids[:32], 4)   # warm up
    runs = [time_generation(llm, prompt_ids, new_tokens) for _ in range(repeats)]
    import llama_cpp

    return {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {gguf.name}, {threads} threads)",
            "prefill_tok_s": round(statistics.median(r[0] for r in runs), 1),
            "decode_tok_s": round(statistics.median(r[1] for r in runs), 1)}


def peer_rows(ours: dict[str, Any], theirs: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = [{"engine": "skippy_zmq, 1 process (fp32 JAX)", "prefill_tok_s": ours.get("prefill_tok_s"),
             "decode_tok_s": ours.get("decode_tok_s")}]
    if theirs is None:
        rows.append({"engine": f"llama.cpp: {NOT_INSTALLED}", "prefill_tok_s": None, "decode_tok_s": None})
        return rows
    rows.append({k: theirs[k] for k in ("engine", "prefill_tok_s", "decode_tok_s")})
    rows.append({"engine": "ratio skippy_zmq / llama.cpp",
                 "prefill_tok_s": ratio(ours.get("prefill_tok_s", 0), theirs["prefill_tok_s"]),
                 "decode_tok_s": ratio(ours.get("decode_tok_s", 0), theirs["decode_tok_s"])})
    return rows


def bench_peers(args: argparse.Namespace, tables: list[str], prior: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    model = Path(args.model)
    title = f"side by side with llama.cpp ({args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, greedy)"
    gguf = find_gguf(model)
    if not llama_cpp_available() or gguf is None:
        status = NOT_INSTALLED if gguf is not None else f"no GGUF found for {model}"
        print(f"[bench] peers: llama.cpp {status}; skipped", flush=True)
        ours = (prior or {}).get("single") or {}
        if ours:
            tables.append(print_table(title, peer_rows(ours, None)))
        return {"status": status}
    ours = (prior or {}).get("single") or bench_single(model, args.prompt_tokens, args.new_tokens,
                                                        1 if args.quick else args.repeats)
    from skippy_zmq.model.tokenizer import TextTokenizer

    prompt = synthetic_prompt(TextTokenizer.load(model), args.prompt_tokens)
    theirs = run_llama_cpp(gguf, prompt, args.new_tokens, 1 if args.quick else args.repeats)
    tables.append(print_table(title, peer_rows(ours, theirs),
                              "llama.cpp runs the Q4_1 weights as stored; skippy_zmq dequantises them to fp32."))
    return {"status": "ok", "llama_cpp": theirs, "ours": ours}
