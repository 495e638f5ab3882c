"""Scale: models of real sizes (random weights, q4) over 1-3 stage processes, and llama.cpp on the
very same weights (the random model's GGUF), in one run.

    skippy-zmq bench scale [--quick] [--shapes llama-3.2-1b] [--recipes q4_1,Q4_K_M] [--out bench-out]

Cases: the Llama-3.2-1B shape on 1, 2 and 3 stages (512 tokens of context, 128 new) and the
Llama-3.1-8B shape on 1 and 2 stages (256 of context, 32 new); `--quick`: 2 layers of the 1B shape
on 1 and 2 stages, a few tokens. Named only (`--shapes qwen3-30b-a3b,llama-3.2-3b`): Qwen3-30B-A3B
(mixture of experts) at full depth on 2 stages and Llama-3.2-3B's shape on 2 stages, with the
MoE / dense decode ratio. Models come from `skippy-zmq random-model --gguf q4_1` and are
cached under models/random/<shape>-L<layers>-s<seed>-q4/ (gitignored) between runs.

Per case and stage count: prefill tok/s (prompt / time to first token), single-stream decode tok/s
(1000 / median inter-token ms) at that context, the aggregate of 8 concurrent streams (window where
all decode), each stage's start (restore and compile, from its log line, and the wall clock to
READY; stages start one after another, so restores never overlap), each stage's peak RSS (VmHWM of its process) beside placement.py's prediction, and the
greedy tokens against llama.cpp's. llama.cpp (llama-cpp-python, as many threads as this machine has
cores, which is what every stage's XLA pool uses) runs one sequence: its 8-stream column is n/a and
our aggregate is compared with its single-stream decode. Conversion: the peak RSS and time of
`skippy-zmq convert --gguf <the case's GGUF> --weights q4` in a subprocess.

`--recipes` (default q4_1, the rows above): llama.cpp's own recipes of each shape (Q4_K_M, Q5_K_M,
Q6_K, Q3_K_M, IQ4_XS), made by llama-quantize from an F16 GGUF of the random weights, ours (the
file's types kept) on 1 and 2 stages beside llama-bench on the very same file (bench/recipes.py).

Memory: one thing at a time (one pipeline, or llama.cpp, or the conversion), never two, so an 8B q4
model is resident once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from skippy_zmq.devtools.bench import greedy
from skippy_zmq.devtools.bench.common import llama_cpp_available, print_table, write_report
from skippy_zmq.devtools.bench.pipeline import measure, stream_prompts
from skippy_zmq.devtools.bench.recipes import recipe_tables
from skippy_zmq.devtools.bench.scale_procs import (logged_peak_gib, model_vocab as _vocab, one_stream, peak_rss_bytes,
                                                     prompt_ids, run_measured, stage_start_times, staggered_pipeline,
                                                     topology_for)

GiB = 1 << 30
SEED = 0
RANDOM_ROOT = Path("models/random")


@dataclass(frozen=True)
class ScaleCase:
    shape: str
    stages: tuple[int, ...]
    context: int            # prompt tokens
    new_tokens: int
    layers: int | None = None
    streams: int = 8

    @property
    def label(self) -> str:
        return self.shape + (f" (first {self.layers} layers)" if self.layers else "")


FULL = (ScaleCase("llama-3.2-1b", (1, 2, 3), 512, 128), ScaleCase("llama-3.1-8b", (1, 2), 256, 32))
QUICK = (ScaleCase("llama-3.2-1b", (1, 2), 48, 8, layers=2, streams=2),)
# Mixture of experts, asked for by name (`--shapes qwen3-30b-a3b,llama-3.2-3b`; 35 GB of model files,
# about 10 minutes once made, 9 or more to make them): Qwen3-30B-A3B at full depth on 2 stages (22 GiB
# resident together, more than a 24 GiB machine holds in one process beside the OS and a driver), and
# the dense shape with about its active parameters (3B) for the MoE / dense decode ratio.
MOE = (ScaleCase("qwen3-30b-a3b", (2,), 256, 32), ScaleCase("llama-3.2-3b", (2,), 256, 32))
MOE_DENSE = ("qwen3-30b-a3b", "llama-3.2-3b")


def model_dir(case: ScaleCase, root: Path = RANDOM_ROOT) -> Path:
    from skippy_zmq.devtools.random_model import SHAPES

    layers = case.layers or SHAPES[case.shape]["num_hidden_layers"]
    return root / f"{case.shape}-L{layers}-s{SEED}-q4"


def ensure_model(case: ScaleCase, root: Path = RANDOM_ROOT) -> tuple[Path, dict[str, Any] | None]:
    """The case's random model and GGUF, made (in a subprocess, measured) unless cached."""
    out = model_dir(case, root)
    if (out / "model.json").is_file() and (out / "model.gguf").is_file():
        return out, None
    cmd = [sys.executable, "-m", "skippy_zmq.cli", "random-model", "--shape", case.shape, "--seed", str(SEED),
           "--weights", "q4", "--gguf", "q4_1", "--out", str(out)]
    if case.layers:
        cmd += ["--layers", str(case.layers)]
    print(f"[bench] scale: making {out} (random weights, checkpoint + GGUF)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    made = run_measured(cmd, out / "random-model.log")
    if made["rc"] != 0:
        raise RuntimeError(f"random-model failed (exit {made['rc']}); see {out / 'random-model.log'}")
    return out, made


def predicted_bytes(topology: Any, stage: Any) -> int:
    """placement.py's prediction of a stage's peak resident bytes, as the stage itself computes it."""
    from skippy_zmq.stage.factory import predict

    return predict(topology, stage).total


def warm_up(engine: Any, vocab: int, case: ScaleCase) -> None:
    """Compile outside the timing: this prompt length, the longest context, the concurrent row buckets.
    Other prompts than the measured ones, so the prefix store has nothing to hit."""
    measure(engine, [prompt_ids(vocab, case.context, seed=2)], 2, strict=False)
    measure(engine, [prompt_ids(vocab, case.context + case.new_tokens - 2, seed=3)], 2, strict=False)
    measure(engine, stream_prompts(prompt_ids(vocab, 16, seed=4), case.streams, salt=100), 4, strict=False)


def pipeline_run(model: Path, case: ScaleCase, n: int, tmp: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    path = topology_for(tmp, model, n, case)
    run_dir = tmp / f"run-{case.shape}-{n}"
    prompt = prompt_ids(_vocab(model), case.context)
    with staggered_pipeline(path, run_dir) as (engine, topology, procs, ready_s):
        warm_up(engine, _vocab(model), case)
        single = one_stream(engine, prompt, case.new_tokens)
        many = measure(engine, stream_prompts(prompt, case.streams, salt=1), case.new_tokens)   # none is `prompt`
        stages = [_stage_row(topology, s, procs[s.id].pid, run_dir, ready_s[s.id]) for s in topology.stages]
    row = {"model": case.label, "engine": "skippy_zmq (q4)", "stages": n, "context": case.context,
           "new_tokens": case.new_tokens, "prefill_tok_s": single["prefill_tok_s"],
           "decode_tok_s": single["decode_tok_s"], f"agg_{case.streams}_streams_tok_s": many["agg_tok_s"],
           "ready_s": round(sum(ready_s.values()), 1), "tokens": single["tokens"]}
    return row, [dict(st, model=case.label, stages=n) for st in stages]


def _stage_row(topology: Any, stage: Any, pid: int, run_dir: Path, ready_s: float) -> dict[str, Any]:
    times = stage_start_times(run_dir / f"{stage.id}.log").get(stage.id, {})
    peak, want = peak_rss_bytes(pid), predicted_bytes(topology, stage)
    return {"stage": stage.id, "layers": f"[{stage.start}, {stage.end})", "restored_s": times.get("restored_s"),
            "compiled_s": times.get("compiled_s"), "ready_s": ready_s, "peak_rss_gib": _gib(peak), "predicted_gib": _gib(want),
            "peak_over_predicted": round(peak / want, 2) if peak and want else None}


def llama_cpp_run(gguf: Path, case: ScaleCase, prompt: list[int]) -> dict[str, Any]:
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    llm = Llama(model_path=str(gguf), n_ctx=case.context + case.new_tokens + 16, n_batch=512,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        llama_generate(llm, prompt[:8], 2)   # warm up
        prefill, decode, tokens = llama_generate(llm, prompt, case.new_tokens)
    finally:
        llm.close()
    return {"model": case.label, "engine": f"llama.cpp ({threads} threads, same GGUF)", "stages": None,
            "context": case.context, "new_tokens": case.new_tokens, "prefill_tok_s": round(prefill, 1),
            "decode_tok_s": round(decode, 2), f"agg_{case.streams}_streams_tok_s": "n/a (one sequence)",
            "ready_s": None, "tokens": tokens[:16]}


def llama_generate(llm: Any, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tok/s, decode tok/s, greedy tokens), timed as ours: prompt to first token, then the rest."""
    llm.reset()
    tokens: list[int] = []
    t0 = time.perf_counter()
    t_first = t0
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
        tokens.append(int(token))
        if len(tokens) == 1:
            t_first = time.perf_counter()
        if len(tokens) >= new_tokens:
            break
    t_end = time.perf_counter()
    return len(prompt) / max(t_first - t0, 1e-9), (len(tokens) - 1) / max(t_end - t_first, 1e-9), tokens


def conversion_run(case: ScaleCase, gguf: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"converted-{case.shape}"
    cmd = [sys.executable, "-m", "skippy_zmq.cli", "convert", "--gguf", str(gguf), "--weights", "q4",
           "--out", str(out)]
    log = tmp / f"convert-{case.shape}.log"
    got = run_measured(cmd, log)
    shutil.rmtree(out, ignore_errors=True)
    return {"model": case.label, "step": "convert --gguf --weights q4", "gguf_gib": _gib(gguf.stat().st_size),
            "wall_s": got["wall_s"], "peak_rss_gib": _gib(got["peak_rss"]), "logged_peak_gib": logged_peak_gib(log),
            "ok": got["rc"] == 0}


def run_case(case: ScaleCase, tmp: Path, root: Path = RANDOM_ROOT) -> dict[str, Any]:
    """Every measurement of one case, one process tree at a time."""
    model, made = ensure_model(case, root)
    rows, stages = [], []
    for n in case.stages:
        row, st = pipeline_run(model, case, n, tmp)
        rows.append(row)
        stages += st
    prompt = prompt_ids(_vocab(model), case.context)
    if llama_cpp_available():
        theirs = llama_cpp_run(model / "model.gguf", case, prompt)
        for row in rows:
            row["greedy_vs_llama_cpp"] = f"{greedy.first_mismatch(row['tokens'], theirs['tokens'])}/{len(theirs['tokens'])}"
            row["decode_over_llama_cpp"] = round(row["decode_tok_s"] / theirs["decode_tok_s"], 2)
            row[f"agg_over_llama_cpp_1_stream"] = round(row[f"agg_{case.streams}_streams_tok_s"] / theirs["decode_tok_s"], 2)
        rows.append(theirs)
    steps = [conversion_run(case, model / "model.gguf", tmp)]
    if made:
        steps.insert(0, {"model": case.label, "step": "random-model --gguf q4_1",
                         "gguf_gib": _gib((model / "model.gguf").stat().st_size),
                         "wall_s": made["wall_s"], "peak_rss_gib": _gib(made["peak_rss"]),
                         "logged_peak_gib": logged_peak_gib(model / "random-model.log"), "ok": made["rc"] == 0})
    return {"case": asdict(case), "model_dir": str(model), "rows": rows, "stages": stages, "steps": steps}


def select_cases(cases: tuple[ScaleCase, ...], shapes: str, by_name: tuple[ScaleCase, ...] = ()
                 ) -> tuple[ScaleCase, ...]:
    """The cases of these comma-separated shapes, from `cases` and those run only when named
    (`by_name`); "": all of `cases`. An unknown name is an error that lists them."""
    wanted = [n.strip() for n in shapes.split(",") if n.strip()]
    pool = cases + tuple(c for c in by_name if c.shape not in {x.shape for x in cases})
    unknown = [n for n in wanted if n not in {c.shape for c in pool}]
    if unknown:
        raise SystemExit(f"bench scale --shapes: unknown {unknown}; the cases are {[c.shape for c in pool]}")
    return tuple(c for c in pool if c.shape in wanted) if wanted else cases


def bench_scale(args: argparse.Namespace, tables: list[str], _prior: dict[str, Any] | None = None) -> dict[str, Any]:
    from skippy_zmq.devtools.bench.recipes import Q4_1, parse_recipes

    cases = select_cases(QUICK if args.quick else FULL, getattr(args, "shapes", ""), () if args.quick else MOE)
    recipes = parse_recipes(getattr(args, "recipes", "") or Q4_1)
    tmp = Path(tempfile.mkdtemp(prefix="skippy-scale-"))
    results = []
    for case in cases if Q4_1 in recipes else ():
        results.append(run_case(case, tmp))
        print(f"[bench] scale: {case.label} done", flush=True)
    result = {"cases": results, "llama_cpp": llama_cpp_available(), "threads": os.cpu_count()}
    text = scale_tables(results) if results else []
    others = tuple(r for r in recipes if r != Q4_1)
    if others:
        result["recipes"] = recipe_results(cases, others, tmp)
        text += recipe_tables(result["recipes"])
    tables.extend(text)
    write_report(args.out, "scale", "skippy_zmq at scale (random weights, q4)", result, text)
    return result


def recipe_results(cases: tuple[ScaleCase, ...], recipes: tuple[str, ...], tmp: Path) -> list[dict[str, Any]]:
    """The llama.cpp recipes of each case's shape (bench/recipes.py), ours and llama-bench per file."""
    from skippy_zmq.devtools.bench import llama_build
    from skippy_zmq.devtools.bench.recipes import recipe_case, recipe_scale_case

    record = llama_build.built()
    out = []
    for case in cases:
        out.append(recipe_case(recipe_scale_case(case), recipes, record["binaries"] if record else None, tmp))
        print(f"[bench] scale: {case.label} recipes done", flush=True)
    return out


def moe_over_dense(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours, decode tok/s of the MoE case over the dense case of about its active parameters, per
    stage count both ran (MOE_DENSE); [] unless both ran."""
    ours = {(res.get("case", {}).get("shape"), r["stages"]): r for res in results for r in res["rows"] if r["stages"]}
    moe, dense = MOE_DENSE
    return [{"moe": moe, "dense": dense, "stages": n, "moe_decode_tok_s": ours[(moe, n)]["decode_tok_s"],
             "dense_decode_tok_s": ours[(dense, n)]["decode_tok_s"],
             "moe_over_dense": round(ours[(moe, n)]["decode_tok_s"] / ours[(dense, n)]["decode_tok_s"], 2)}
            for (shape, n) in ours if shape == moe and (dense, n) in ours]


def scale_tables(results: list[dict[str, Any]]) -> list[str]:
    rows = [{k: v for k, v in r.items() if k != "tokens"} for res in results for r in res["rows"]]
    stages = [st for res in results for st in res["stages"]]
    steps = [st for res in results for st in res["steps"]]
    ratio = moe_over_dense(results)
    extra = [print_table("at scale: mixture of experts over dense (ours, single-stream decode)", ratio,
                         "Qwen3-30B-A3B reads 8 of 128 experts a layer, about 3.3B parameters a token; "
                         "Llama-3.2-3B's shape holds about as many, all dense.")] if ratio else []
    return extra + [
        print_table("at scale: speed (random weights of the real shape, q4; llama.cpp on the same weights)", rows,
                    "prefill = prompt / time to first token; decode = 1000 / median inter-token ms, one stream; "
                    "agg = tokens per second while all streams decode. llama.cpp runs one sequence: its "
                    "aggregate is n/a, and ours is set against its single-stream decode. greedy_vs_llama_cpp = "
                    "leading greedy tokens equal to llama.cpp's: its Q8 activation arithmetic (and f16 KV) parts near "
                    "ties, and random weights amplify that with depth (2 layers: 14-16 of 16 equal, logits corr "
                    ">= 0.9997; the 32-layer 8B: corr 0.993, parting within the first tokens)."),
        print_table("at scale: stage start and memory", stages,
                    "restored / compiled: the stage's own log line (restore of its items, then compiling its "
                    "buckets; from the persistent JAX cache when warm: SKIPPY_JAX_CACHE=off for a cold start); ready_s: spawn to READY. Stages start one at a time, downstream first, each "
                    "once the one before is READY (restores never overlap); peak RSS = VmHWM of the stage process at the end of its run; "
                    "predicted = placement.py (weights + KV + prefix-store budget + overhead)."),
        print_table("at scale: making and converting the model", steps,
                    "peak_rss = wait4's ru_maxrss of the subprocess, an upper bound: at exec Linux records the high-water "
                    "mark of the memory map it replaces, for a vforked child this bench process's (llama.cpp's model "
                    "included); "
                    "logged = the command's own VmHWM, what the conversion itself held (the figure the goal reads); "
                    "random-model appears when the model was not cached."),
    ]


def _gib(n: int | None) -> float | None:
    return round(n / GiB, 2) if n else None
