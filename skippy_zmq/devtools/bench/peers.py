"""Peers: the llama.cpp a user deploys, `llama-server` (built by `make peers`), beside ours, in one run.

Both engines are driven through their OpenAI-compatible `/v1/completions` with the same client code
(`stream_completion`): the same prompt ids (the GGUF's vocabulary is ours), greedy, `ignore_eos`,
streamed, on the same GGUF (ours runs its Q4_1 levels as q4) and the same cores (2 threads for
llama.cpp). Every prompt is used once per engine, so neither engine's prompt cache can serve it.

- single stream: prefill tok/s (prompt ÷ time to first token) and decode tok/s (tokens after the
  first ÷ the time they took), SmolLM2 and the random 1B / 8B shapes (their GGUFs carry no
  vocabulary, on which llama-server aborts detokenizing: llama.cpp's rows come from llama-bench),
  and llama-quantize's recipes of them (`--peer-models llama-3.2-1b:Q4_K_M`: ours runs the file's
  own blocks; bench/recipes.py), SmolLM2's too (`smollm2:Q4_K_M`: its GGUF requantised, vocabulary and
  all, so llama-server serves the same file); where llama-server serves the model, both engines are up
  at once and take turns prompt by prompt (a shared machine's load falls on both alike);
- speculation: copy and chat workloads, ours on vs off, `llama-server --spec-type T` for every
  n-gram type it has vs plain, tokens over request time; greedy text compared with plain for both;
- concurrency: 1, 8, 16, 32 streams at once, plain decoding, ours on 1/2/3 stages vs
  `llama-server -np N` (continuous batching): aggregate tok/s and p50/p99 time between tokens;
- pipeline: one stream through 2 and 3 processes, ours vs llama-server over as many rpc-servers
  with the same even layer split, at 0 ms and at 20 ms per hop: at 20 ms every connection between
  two processes of either engine (our driver and stages; llama-server and its rpc-servers) passes
  through a relay that holds each byte 20 ms each way (bench/relay.py: this kernel has no netem).

Without a build (`make peers`, or `bench peers --build`) the llama.cpp side says so and is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skippy_zmq.devtools.bench.common import find_gguf, print_table, synthetic_prompt, write_report
from skippy_zmq.devtools.bench.peers_client import (concurrent, interleaved_streams, run_together, single_stream,
                                                    stream_completion)
from skippy_zmq.devtools.bench.peers_engines import THREADS, free_port, llama_bench, llama_rpc, llama_server, our_server

NOT_BUILT = "not built (make peers)"
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
STREAM_COUNTS = (1, 8, 16, 32)
HOP_DELAYS_MS = (0.0, 20.0)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours and theirs else None


# ---------------------------------------------------------------- the models and prompts


@dataclass(frozen=True)
class PeerModel:
    name: str
    ours: Path           # q4 checkpoint holding the GGUF's levels (a recipe's: the file's own blocks)
    gguf: Path
    vocab_ids: Any       # callable(n, seed) -> prompt ids
    weights: str = "q4"  # what our stages run ("gguf" for a recipe's checkpoint)
    server: bool = False  # llama-server can serve the GGUF (it has a vocabulary); else llama-bench


def peer_models(args: argparse.Namespace, names: list[str]) -> list[PeerModel]:
    from skippy_zmq.devtools.bench.spec import q4_model
    from skippy_zmq.text.tokenizer import TextTokenizer

    out = []
    for name in names:
        if name == "smollm2" or name.startswith("smollm2:"):
            model = Path(args.model)
            gguf = find_gguf(model)
            if gguf is None:
                print(f"[peers] no GGUF found for {model}; SmolLM2 skipped", flush=True)
                continue
            filler = synthetic_prompt(TextTokenizer.load(model), 4096)

            def ids(n: int, seed: int, f: list[int] = filler) -> list[int]:
                return [f[(seed * 37) % 512]] + f[1 + seed:n + seed]

            if name == "smollm2":
                out.append(PeerModel(name, q4_model(model, gguf), gguf, ids, server=True))
            else:
                made = smollm2_recipe(gguf, name.split(":", 1)[1])
                out.append(PeerModel(name, made.ours, made.gguf, ids, "gguf", server=True))
        elif ":" in name:
            out.append(recipe_peer(name))
        else:
            from skippy_zmq.devtools.bench.scale import ScaleCase, _vocab, ensure_model, prompt_ids

            model, _made = ensure_model(ScaleCase(name, (1,), 256, 32))
            vocab = _vocab(model)
            out.append(PeerModel(name, model, model / "model.gguf",
                                 lambda n, seed, v=vocab: prompt_ids(v, n, seed=seed + 10)))
    return out


def smollm2_recipe(gguf: Path, recipe: str) -> Any:
    """SmolLM2's GGUF requantised into `recipe` by llama-quantize, and our checkpoint of it (recipes.FileRecipe),
    made unless there."""
    from skippy_zmq.devtools.bench import llama_build
    from skippy_zmq.devtools.bench.recipes import FileRecipe, ensure_recipe

    try:
        made = FileRecipe(gguf, recipe)
    except ValueError as exc:
        raise SystemExit(f"--peer-models smollm2:{recipe}: {exc}") from None
    if not made.gguf.is_file() or not (made.ours / "model.json").is_file():
        record = llama_build.built()
        if record is None:
            raise SystemExit(f"--peer-models smollm2:{recipe}: llama-quantize is {NOT_BUILT}")
        ensure_recipe(made, record["binaries"]["llama-quantize"])
    return made


def recipe_peer(name: str) -> PeerModel:
    """SHAPE:RECIPE (llama-3.2-1b:Q4_K_M): llama-quantize's file of the random shape and our checkpoint
    of it, made unless cached (bench/recipes.py), ours running the file's own blocks."""
    from skippy_zmq.devtools.bench import llama_build
    from skippy_zmq.devtools.bench.recipes import RecipeModel, ensure_recipe
    from skippy_zmq.devtools.bench.scale_procs import model_vocab, prompt_ids

    shape, recipe = name.split(":", 1)
    record = llama_build.built()
    model = RecipeModel(shape, recipe)
    if not model.gguf.is_file() or not (model.ours / "model.json").is_file():
        if record is None:
            raise SystemExit(f"--peer-models {name}: llama-quantize is {NOT_BUILT}")
        ensure_recipe(model, record["binaries"]["llama-quantize"])
    vocab = model_vocab(model.ours)
    return PeerModel(name, model.ours, model.gguf, lambda n, seed, v=vocab: prompt_ids(v, n, seed=seed + 10), "gguf")


# ---------------------------------------------------------------- the bench


def single_rows(m: PeerModel, binaries: dict[str, str] | None, args: argparse.Namespace, tmp: Path
                ) -> list[dict[str, Any]]:
    prompts = [m.vocab_ids(args.prompt_tokens, seed) for seed in range(1, 1 + args.repeats)]
    warm = m.vocab_ids(args.prompt_tokens, 99)
    context = args.prompt_tokens + args.new_tokens + 64
    rows = []
    with contextlib.ExitStack() as up:
        engines = [(up.enter_context(our_server(m.ours, 1, tmp / f"ours-{m.name}", 1, context, weights=m.weights)),
                    {"speculative": False})]
        if binaries and m.server:
            engines.append((up.enter_context(llama_server(binaries["llama-server"], m.gguf, free_port(),
                                                          tmp / f"llama-{m.name}", 1, context)), None))
        for base, extra in engines:
            stream_completion(base, warm, 8, extra)
        ours, *theirs_run = interleaved_streams(engines, prompts, args.new_tokens)
    rows.append({"model": m.name, "engine": f"skippy_zmq {m.weights}, 1 stage", **_speeds(ours)})
    if theirs_run:
        theirs, engine = theirs_run[0], "llama-server"   # (up beside ours, turns prompt by prompt)
    elif binaries:   # a random model's GGUF has no vocabulary: llama-server aborts detokenizing its output
        theirs = llama_bench(binaries["llama-bench"], m.gguf, args.prompt_tokens, args.new_tokens, args.repeats)
        engine = "llama-bench (in process; no vocabulary for llama-server)"
    if binaries:
        rows.append({"model": m.name, "engine": engine, **_speeds(theirs)})
        rows.append({"model": m.name, "engine": "ratio ours ÷ llama.cpp",
                     "prefill_tok_s": ratio(ours["prefill_tok_s"], theirs["prefill_tok_s"]),
                     "decode_tok_s": ratio(ours["decode_tok_s"], theirs["decode_tok_s"])})
    return rows


def _speeds(run: dict[str, Any]) -> dict[str, Any]:
    return {"prefill_tok_s": run["prefill_tok_s"], "decode_tok_s": run["decode_tok_s"]}


def spec_rows(m: PeerModel, binary: str | None, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Copy and chat, one stream: decode tok/s with speculation and without, and whether greedy text
    with it equals the text without it, for both engines."""
    from skippy_zmq.devtools.bench.spec_workloads import workloads
    from skippy_zmq.text.tokenizer import TextTokenizer

    # a narrower run than --quick (the suite's test: one prompt each, one llama-server type) may name them
    work = workloads(TextTokenizer.load(m.ours), getattr(args, "spec_prompts", 2 if args.quick else None))
    new = args.new_tokens
    context = max(len(p) for ps in work.values() for p in ps) + new + 64
    rows = []
    with our_server(m.ours, 1, tmp / f"ours-spec-{m.name}", 1, context) as base:
        stream_completion(base, work["chat"][0], 8)
        for workload, prompts in work.items():
            off = single_stream(base, prompts, new, {"speculative": False})
            on = single_stream(base, prompts, new, {"speculative": True})
            rows.append(_spec_row("skippy_zmq q4, 1 stage", "ngram (ours)", workload, off, on))
    if binary:
        plain: dict[str, dict[str, Any]] = {}
        with llama_server(binary, m.gguf, free_port(), tmp / "llama-spec", 1, context) as base:
            stream_completion(base, work["chat"][0], 8)
            for workload, prompts in work.items():
                plain[workload] = single_stream(base, prompts, new)
        # quick: two types, the path is the same
        for spec_type in getattr(args, "spec_types", SPEC_TYPES[:2] if args.quick else SPEC_TYPES):
            with llama_server(binary, m.gguf, free_port(), tmp / "llama-spec", 1, context, spec_type) as base:
                stream_completion(base, work["chat"][0], 8)
                for workload, prompts in work.items():
                    on = single_stream(base, prompts, new)
                    rows.append(_spec_row("llama-server", spec_type, workload, plain[workload], on))
    return rows


def _spec_row(engine: str, method: str, workload: str, off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    same = sum(a == b for a, b in zip(off["texts"], on["texts"]))
    return {"engine": engine, "speculation": method, "workload": workload, "off_tok_s": off["e2e_tok_s"],
            "on_tok_s": on["e2e_tok_s"], "speedup": ratio(on["e2e_tok_s"], off["e2e_tok_s"]),
            "greedy_same": f"{same}/{len(off['texts'])}"}


def concurrency_rows(m: PeerModel, binary: str | None, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    counts = getattr(args, "stream_counts", (1, 4) if args.quick else STREAM_COUNTS)
    new, prompt_len = (16, 32) if args.quick else (64, 64)
    context = prompt_len + new + 64
    rows = []
    salt = iter(range(1000, 100000))
    for stages in args.stages:
        with our_server(m.ours, stages, tmp / f"ours-conc-{stages}", max(counts), context) as base:
            run_together(base, [m.vocab_ids(prompt_len, next(salt)) for _ in range(max(counts))], 8)
            for n in counts:   # plain decoding, as llama-server's
                got = concurrent(base, [m.vocab_ids(prompt_len, next(salt)) for _ in range(n)], new,
                                 {"speculative": False})
                rows.append({"engine": f"skippy_zmq q4, {stages} stage(s)", **got})
    if binary:
        for n in counts:
            with llama_server(binary, m.gguf, free_port(), tmp / "llama-conc", n, context) as base:
                run_together(base, [m.vocab_ids(prompt_len, next(salt)) for _ in range(n)], 8)
                got = concurrent(base, [m.vocab_ids(prompt_len, next(salt)) for _ in range(n)], new)
            rows.append({"engine": f"llama-server -np {n}", **got})
    return rows


def rpc_rows(m: PeerModel, record: dict[str, Any] | None, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """One stream through 2 and 3 processes, plain decoding, at each per-hop delay: ours with one KV lane
    beside llama-server (one slot) over 2 and 3 rpc-servers with the same even layer split; at 20 ms
    both engines behind relays."""
    new, prompt_len = (16, 32) if args.quick else (64, 64)
    context = prompt_len + new + 64
    rows = []
    for hop_ms in getattr(args, "hop_delays", HOP_DELAYS_MS):
        for stages in (s for s in args.stages if s > 1):
            row: dict[str, Any] = {"stages": stages, "hop_ms": hop_ms}
            with our_server(m.ours, stages, tmp / f"ours-hop-{stages}", 1, context, hop_ms) as base:
                run_together(base, [m.vocab_ids(prompt_len, 7000 + stages)], 8)
                got = concurrent(base, [m.vocab_ids(prompt_len, 6000 + stages)], new, {"speculative": False})
            row["ours_tok_s"] = got["agg_tok_s"]
            if record:
                with llama_rpc(record["binaries"], m.gguf, stages, tmp / "llama-rpc", context, hop_ms) as base:
                    run_together(base, [m.vocab_ids(prompt_len, 5000 + stages)], 8)
                    got = concurrent(base, [m.vocab_ids(prompt_len, 6000 + stages)], new)
                row["llama_rpc_tok_s"] = got["agg_tok_s"]
                row["ratio"] = ratio(row["ours_tok_s"], got["agg_tok_s"])
            rows.append(row)
    return rows


def ratio_rows(conc: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours ÷ llama-server at each stream count, per stage count."""
    theirs = {r["streams"]: r["agg_tok_s"] for r in conc if r["engine"].startswith("llama-server")}
    return [{"engine": r["engine"], "streams": r["streams"], "ratio": ratio(r["agg_tok_s"], theirs.get(r["streams"]))}
            for r in conc if r["engine"].startswith("skippy_zmq") and r["streams"] in theirs]


def peers_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """A PNG per table of this run (`bench peers` alone; `bench all` draws them with the others)."""
    from skippy_zmq.devtools.bench.plots import PEERS_PLOTS, matplotlib_available

    if not matplotlib_available():
        print("[peers] plots skipped: matplotlib is not installed (pip install -e '.[bench]')", flush=True)
        return []
    out.mkdir(parents=True, exist_ok=True)
    return [plot(result[table], out / name) for table, plot, name in PEERS_PLOTS if result.get(table)]


def bench_peers(args: argparse.Namespace, tables: list[str], _prior: dict[str, Any] | None = None) -> dict[str, Any]:
    import tempfile

    from skippy_zmq.devtools.bench import llama_build

    if getattr(args, "build", False):
        llama_build.build()
    record = llama_build.built()
    binary = record["binaries"]["llama-server"] if record else None
    if binary is None:
        print(f"[peers] llama-server {NOT_BUILT}: only our rows", flush=True)
    everything = args.suite == "peers" and not args.quick
    names = [n for n in (getattr(args, "peer_models", "") or ("smollm2,llama-3.2-1b,llama-3.1-8b" if everything
             else "smollm2")).split(",") if n]
    models = peer_models(args, names)
    result: dict[str, Any] = {"llama_server": record or NOT_BUILT, "threads": THREADS}
    with tempfile.TemporaryDirectory(prefix="skippy-peers-") as t:
        tmp = Path(t)
        single = [row for m in models for row in single_rows(m, record["binaries"] if record else None, args, tmp)]
        result["single"] = single
        tables.append(print_table(f"single stream, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
                                  "greedy", single))
        if models and models[0].name == "smollm2":
            spec = spec_rows(models[0], binary, args, tmp)
            result["speculation"] = spec
            tables.append(print_table("speculation, SmolLM2, 1 stream, greedy", spec,
                                      "tok/s = completion tokens ÷ request time (prompt included), over the prompts: a "
                                      "stream that sends a verify window's tokens in one chunk cannot inflate it; "
                                      "greedy_same: prompts whose text with speculation equals the text without"))
            conc = concurrency_rows(models[0], binary, args, tmp)
            result["concurrency"] = conc
            tables.append(print_table("concurrency, SmolLM2 (64-token prompts, 64 new tokens each, plain decoding)", conc))
            tables.append(print_table("aggregate ÷ llama-server -np N", ratio_rows(conc)))
            rpc = rpc_rows(models[0], record, args, tmp)
            result["rpc"] = rpc
            tables.append(print_table("pipeline, 1 stream, plain: ours on N stages ÷ llama-server over N rpc-servers "
                                      "(same even layer split); hop_ms: each way between any two processes, through "
                                      "relays (bench/relay.py)", rpc))
    smol = [r for r in single if r["model"] == "smollm2"]
    if binary and len(smol) >= 2:
        result["llama_cpp"] = {"engine": "llama-server", "decode_tok_s": smol[1]["decode_tok_s"],
                               "prefill_tok_s": smol[1]["prefill_tok_s"]}
    if args.suite == "peers":
        from skippy_zmq.devtools.bench.common import machine

        result["machine"] = machine()
        plots = peers_plots(result, Path(args.out))
        result["plots"] = [p.name for p in plots]
        write_report(args.out, "peers", "skippy_zmq beside llama-server (same GGUF, same cores, one run)",
                     result, tables + [f"\n![{p.stem}]({p.name})\n" for p in plots])
    return result
