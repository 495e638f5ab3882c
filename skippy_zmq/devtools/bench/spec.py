"""Speculative decoding, side by side: ours with drafting off and on, and llama.cpp plain and with
prompt lookup, on the real SmolLM2-135M-Instruct, in one run.

    skippy-zmq bench spec [--quick] [--weights q4] [--out bench-out]

Workloads (chat-templated with the model's tokenizer, 128 new tokens each, greedy, ignore_eos so
every run generates exactly that many tokens): "copy", 8 requests whose answer repeats much of the
prompt (repeat a text, fix typos, add type hints, list to JSON, quote a summary, CSV to Markdown,
rename a variable, polish an email; each over a 150-300 token source in spec_workloads.py), and "chat",
8 open questions with little to copy.

Rows:
- ours, 1 stage, 1 stream, spec off / on, copy and chat (the prompts one after another);
- llama.cpp (llama-cpp-python, same GGUF, same prompt ids, 2 threads, greedy) plain and with
  `LlamaPromptLookupDecoding(num_pred_tokens=2)` and `=10`;
- ours, 3 stages, SKIPPY_HOP_DELAY_MS 5 and 20 (bench/hops.py), copy, off / on;
- ours, 2 stages, 8 concurrent streams, off / on: "copy" (the 8 copy prompts) and "mixed"
  (4 copy + 4 chat); the goal reads the mixed row.

Off and on run on the same pipeline (the topology's `driver.speculative`; "off" requests opt out
with `GenRequest(speculative=False)`), interleaved prompt by prompt so drift on a shared machine
touches both alike. Decode tok/s = generated tokens after the first / time from the first token to
the last, summed over the prompts (aggregate) and per prompt (median). Acceptance comes from the
final event's `stats["speculative"]` ({windows, drafted, accepted}); the greedy identity check
compares every prompt's tokens on against off (a mismatch is reported, never fatal).

Stages run q4 weights by default: the GGUF's own Q4_1 levels (a q4 checkpoint converted from the
same GGUF, found beside the model or converted once into models/<name>-q4), so ours and llama.cpp
compute from the same weights; `--weights` names another format (that one runs off the model
directory as given). `--quick`: 1 prompt per workload, 32 tokens, one pipeline (2 stages at 20 ms
per hop: both workloads one stream at a time, and the concurrent row as 2 streams), 512 positions
a session, no warm-up requests and no idle warm-ups in the stages (a test of the paths, not of the
speed: the pipeline's start does not wait for every reachable shape to compile).

Phase timings go to stderr ("[spec] ..."), so a long run can be followed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from skippy_zmq.devtools.bench.common import find_gguf, llama_cpp_available, print_table, stage_overrides, write_report
from skippy_zmq.devtools.bench.goals import _ratio
from skippy_zmq.devtools.bench.hops import hop_delay
from skippy_zmq.devtools.bench.spec_goals import (LOOKUP, STREAMS, acceptance, concurrent_speed, decode_speed, identity,
                                                  spec_counts, spec_goal_rows)
from skippy_zmq.devtools.bench.spec_workloads import workloads

SPECULATIVE: dict[str, Any] = {"method": "ngram"}   # the defaults (driver/speculative.py SpeculativeConfig)
NEW_TOKENS, QUICK_TOKENS = 128, 32
CONTEXT, QUICK_CONTEXT = 1024, 512   # driver.max_context of the pipelines
QUICK_PROMPTS = 1
LLAMA_THREADS = 2
DELAYS = (5.0, 20.0)            # ms per hop, 3 stages
PIPELINE_START_S = 300.0        # running_pipeline's bound on a start (compiles on 2 shared cores)
LANES = 8


# ---------------------------------------------------------------- measurement


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Phase timing on stderr."""
    t0 = time.perf_counter()
    print(f"[spec] {name} ...", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        print(f"[spec] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def one_request(engine: Any, ids: list[int], new_tokens: int, speculative: bool | None, rid: str
                ) -> dict[str, Any]:
    """One request through the pipeline: its tokens, token arrival times and speculation counts.
    `speculative`: False opts out, None takes the driver's setting."""
    from skippy_zmq.engine.request import GenRequest

    stamps: list[float] = []
    tokens: list[int] = []
    stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    for event in engine.generate_blocking(GenRequest(rid, tuple(ids), max_tokens=new_tokens, ignore_eos=True,
                                                     speculative=speculative)):
        if event.token_id is not None:
            stamps.append(time.perf_counter())
            tokens.append(int(event.token_id))
        if event.finish_reason is not None:
            stats = dict(event.stats or {})
    return {"tokens": tokens, "n": len(tokens), "stamps": stamps, "ttft_s": (stamps[0] - t0) if stamps else None,
            "decode_s": (stamps[-1] - stamps[0]) if stamps else 0.0, "spec": spec_counts(stats)}


def concurrent(engine: Any, prompts: list[list[int]], new_tokens: int, speculative: bool | None
               ) -> list[dict[str, Any]]:
    """All prompts at once, one thread each; results in prompt order."""
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    errors: list[str] = []

    def go(i: int) -> None:
        try:
            results[i] = one_request(engine, prompts[i], new_tokens, speculative, f"spec-{i}")
        except Exception as exc:   # noqa: BLE001 - reported below with the stream it came from
            errors.append(f"stream {i}: {exc}")

    # daemon: a stream stuck on an engine that went away must not keep the process from exiting
    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} streams failed: {errors[0]}")
    return [r for r in results if r is not None]


@dataclass
class Measured:
    """Off and on runs of one configuration and workload, prompt by prompt."""

    engine: str
    config: str
    workload: str
    stages: int | None
    delay_ms: float | None
    streams: int
    off: list[dict[str, Any]] = field(default_factory=list)
    on: list[dict[str, Any]] = field(default_factory=list)
    on_label: str = "on"
    off_label: str = "off"


def sequential(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list, list]:
    """Each prompt off and on in turn, alternating which goes first."""
    off, on = [], []
    for i, p in enumerate(prompts):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            r = one_request(engine, p, new_tokens, False if mode == "off" else None, f"spec-{mode}-{i}")
            (off if mode == "off" else on).append(r)
    return off, on


def warm_up(engine: Any, prompts: list[list[int]], new_tokens: int, together: list[list[list[int]]]) -> None:
    """Compile outside the timing: the shortest and the longest prompt (their attention buckets), off and
    on, one at a time; then each set of prompts that a job runs concurrently (its row buckets), off and
    on. Untimed; later requests may hit the prefix cache (TTFT only: decode is what is measured)."""
    by_len = sorted(prompts, key=len)
    for p in {id(x): x for x in (by_len[0], by_len[-1])}.values():
        for spec in (False, None):
            one_request(engine, p, new_tokens, spec, "warm")
    for group in together:
        for spec in (False, None):
            concurrent(engine, group, new_tokens, spec)


def pipeline_topology(tmp: Path, model: Path, stages: int, name: str, on: dict[str, Any], depth: int | None = None
                      ) -> tuple[Path, dict[str, Any] | None]:
    """A topology with speculation in the driver when this build accepts it: the full settings, else just
    the method, else none (then "on" requests decode plainly). `depth`: verify windows of one stream in
    flight (None: the default, one per stage). Returns (path, the settings used)."""
    from skippy_zmq.devtools.harness import write_topology
    from skippy_zmq.config.topology import TopologyError

    base = {**dict(kv_lanes=LANES, driver__max_sessions=LANES, driver__dead_after_s=30.0,
                   driver__request_timeout_s=900.0, driver__max_context=CONTEXT), **on}
    full = {**SPECULATIVE, **({"depth": depth} if depth is not None else {})}
    for spec in (full, {"method": SPECULATIVE["method"]}):
        try:
            return write_topology(tmp, model, stages, name=name, driver__speculative=dict(spec), **base), dict(spec)
        except TopologyError as exc:
            print(f"[spec] topology refuses driver.speculative={spec}: {exc}", file=sys.stderr, flush=True)
    return write_topology(tmp, model, stages, name=name, **base), None


def run_pipeline_case(model: Path, tmp: Path, stages: int, delay_ms: float, on: dict[str, Any],
                      jobs: list[tuple[str, str, list[list[int]], int]], new_tokens: int,
                      warm: list[list[int]], depth: int | None = None) -> tuple[list[Measured], dict[str, Any] | None]:
    """One pipeline (started under the hop delay, bounded, always shut down) and its jobs:
    (config label, workload, prompts, streams); streams 1 = the prompts one after another."""
    from skippy_zmq.devtools.harness import running_pipeline

    name = f"spec-{stages}-{delay_ms:g}" + (f"-d{depth}" if depth is not None else "")
    path, spec = pipeline_topology(tmp, model, stages, name, on, depth)
    out = []
    with ExitStack() as stack:
        with phase(f"{name}: start ({stages} stage(s), {delay_ms:g} ms/hop)"), hop_delay(delay_ms):
            engine, _tok, _topo, _procs = stack.enter_context(
                running_pipeline(path, tmp / name, timeout=PIPELINE_START_S, warm=True))
        if warm:   # --quick passes none: its timings include first-use compiles (a test of the paths)
            with phase(f"{name}: warm-up"):
                warm_up(engine, warm, new_tokens, [j[2] for j in jobs if j[3] > 1])
        for config, workload, prompts, streams in jobs:
            m = Measured("ours", config, workload, stages, delay_ms or None, streams)
            with phase(f"{name}: {config}, {workload}, {len(prompts)} prompts"):
                if streams == 1:
                    m.off, m.on = sequential(engine, prompts, new_tokens)
                else:
                    m.off = concurrent(engine, prompts, new_tokens, False)
                    m.on = concurrent(engine, prompts, new_tokens, None)
            if spec is None:
                m.on_label = "on (not in this build: plain decode)"
            out.append(m)
        with phase(f"{name}: shutdown"):
            stack.close()
    return out, spec


# ---------------------------------------------------------------- llama.cpp


def llama_runs(gguf: Path, work: dict[str, list[list[int]]], new_tokens: int, lookup: int | None
               ) -> dict[str, list[dict[str, Any]]]:
    """Each workload's prompts one after another on one Llama (plain, or prompt lookup with
    num_pred_tokens=lookup); the KV is cleared before every prompt (llama_generate's reset)."""
    from llama_cpp import Llama

    from skippy_zmq.devtools.bench.scale import llama_generate

    kwargs: dict[str, Any] = {}
    if lookup is not None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    longest = max(len(p) for ps in work.values() for p in ps)
    llm = Llama(model_path=str(gguf), n_ctx=longest + new_tokens + 16, n_batch=512,
                n_threads=LLAMA_THREADS, n_threads_batch=LLAMA_THREADS, verbose=False, **kwargs)
    try:
        first = next(iter(work.values()))[0]
        llama_generate(llm, first[:32], 4)   # warm up
        out: dict[str, list[dict[str, Any]]] = {}
        for workload, prompts in work.items():
            with phase(f"llama.cpp {'plain' if lookup is None else f'prompt lookup {lookup}'}, {workload}"):
                out[workload] = []
                for p in prompts:
                    _prefill, decode, tokens = llama_generate(llm, p, new_tokens)
                    out[workload].append({"tokens": tokens, "n": len(tokens), "stamps": [], "spec": None,
                                          "decode_s": (len(tokens) - 1) / decode if decode > 0 else 0.0})
        return out
    finally:
        llm.close()


def llama_measured(gguf: Path, work: dict[str, list[list[int]]], new_tokens: int) -> list[Measured]:
    """llama.cpp plain, then with prompt lookup at each num_pred_tokens; rows per workload."""
    plain = llama_runs(gguf, work, new_tokens, None)
    lookups = {n: llama_runs(gguf, work, new_tokens, n) for n in LOOKUP}
    return [Measured("llama.cpp", f"prompt lookup {n}", workload, None, None, 1, off=plain[workload],
                     on=lookups[n][workload]) for workload in work for n in LOOKUP]


# ---------------------------------------------------------------- weights and rows


def spec_weights(args: argparse.Namespace) -> str:
    """--weights, or q4 (the GGUF's own levels, so ours and llama.cpp compute from the same weights)."""
    return getattr(args, "weights", None) or "q4"


def q4_model(model: Path, gguf: Path | None) -> Path:
    """A q4 checkpoint holding the GGUF's own Q4_1 levels: one beside the model converted from the same
    file (its source.json's sha256), else converted once into models/<name>-q4. Without a GGUF the model
    directory as given (its stages quantise to q4 at load)."""
    if gguf is None:
        return model
    try:
        sha = json.loads((model / "source.json").read_text()).get("sha256")
    except (OSError, ValueError):
        sha = None
    for cand in sorted(p for p in model.parent.iterdir() if p.is_dir()):
        try:
            src = json.loads((cand / "source.json").read_text())
        except (OSError, ValueError):
            continue
        if src.get("weights") == "q4" and src.get("file") == gguf.name and (sha is None or src.get("sha256") == sha) \
                and (cand / "model.json").is_file():
            return cand
    out = model.parent / f"{model.name}-q4"
    with phase(f"converting {gguf.name} to a q4 checkpoint at {out}"):
        subprocess.run([sys.executable, "-m", "skippy_zmq.cli", "convert", "--gguf", str(gguf), "--weights", "q4",
                        "--out", str(out)], check=True)
    return out


def measured_rows(ms: list[Measured], new_tokens: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(speed rows, acceptance rows, identity rows) of every configuration."""
    rows, acc, ident = [], [], []
    done_plain: set[tuple[str, str]] = set()
    for m in ms:
        speed = concurrent_speed if m.streams > 1 else decode_speed
        base = {"engine": m.engine, "config": m.config, "workload": m.workload, "stages": m.stages,
                "delay_ms": m.delay_ms, "streams": m.streams, "prompts": len(m.off), "new_tokens": new_tokens}
        off, on = speed(m.off), speed(m.on)
        a = acceptance(m.on)
        same = identity([r["tokens"] for r in m.off], [r["tokens"] for r in m.on])
        if m.engine == "llama.cpp":
            if (m.engine, m.workload) not in done_plain:
                done_plain.add((m.engine, m.workload))
                rows.append({**base, "config": "plain", "speculation": "off", "label": "off", **off,
                             "ratio_to_off": None, "acceptance": None, "accepted_per_step": None, "identical": None})
        else:
            rows.append({**base, "speculation": "off", "label": m.off_label, **off, "ratio_to_off": None,
                         "acceptance": None, "accepted_per_step": None, "identical": None})
        rows.append({**base, "speculation": "on", "label": m.on_label, **on,
                     "ratio_to_off": _ratio(on["decode_tok_s"], off["decode_tok_s"]),
                     "acceptance": a["acceptance"], "accepted_per_step": a["accepted_per_step"],
                     "identical": same["identical"]})
        acc.append({"engine": m.engine, "config": m.config, "workload": m.workload, **a,
                    "note": None if m.engine == "ours" else "llama-cpp-python does not report acceptance"})
        ident.append({"engine": m.engine, "config": m.config, "workload": m.workload, **same,
                      "against": "ours off" if m.engine == "ours" else "llama.cpp plain"})
    return rows, acc, ident


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("engine", "config", "workload", "label", "prompts", "decode_tok_s", "median_tok_s", "steady_tok_s",
            "ratio_to_off", "acceptance", "accepted_per_step", "identical")
    renamed = {"label": "speculation"}
    return [{renamed.get(k, k): r.get(k) for k in keys} for r in rows]


# ---------------------------------------------------------------- the suite


def bench_spec(args: argparse.Namespace, tables: list[str], _prior: dict[str, Any] | None = None) -> dict[str, Any]:
    from skippy_zmq.text.tokenizer import TextTokenizer

    t_start = time.perf_counter()
    quick = bool(args.quick)
    new_tokens = QUICK_TOKENS if quick else NEW_TOKENS
    model = Path(args.model).absolute()
    gguf = find_gguf(model)
    weights = spec_weights(args)
    ours_model = q4_model(model, gguf) if weights == "q4" else model
    on = {**stage_overrides(args), "weights": weights}
    if quick:   # its prompts and 32 tokens fit 512 positions: one attention length fewer to compile
        on["driver__max_context"] = QUICK_CONTEXT
        on["idle_warmups"] = False   # running_pipeline(warm=True) would wait for every shape's compile
    work = workloads(TextTokenizer.load(model), QUICK_PROMPTS if quick else None)
    mixed = work["copy"][:STREAMS // 2] + work["chat"][:STREAMS // 2]
    tmp = Path(tempfile.mkdtemp(prefix="skippy-spec-"))
    measured: list[Measured] = []

    if quick:   # one pipeline: every kind of row, on the paths a hop adds
        hop = "2 stages, 20 ms/hop"
        one, spec_used = run_pipeline_case(
            ours_model, tmp, 2, 20.0, on,
            [(hop, "copy", work["copy"], 1), (hop, "chat", work["chat"], 1),
             ("2 stages, 2 streams, 20 ms/hop", "mixed", [work["copy"][0], work["chat"][0]], 2)],
            new_tokens, [])
    else:
        one, spec_used = run_pipeline_case(ours_model, tmp, 1, 0.0, on, [("1 stage", "copy", work["copy"], 1),
                                                                      ("1 stage", "chat", work["chat"], 1)],
                                           new_tokens, work["copy"] + work["chat"])
    measured += one
    llama_status = "ok"
    if llama_cpp_available() and gguf is not None:
        measured += llama_measured(gguf, work, new_tokens)
    else:
        llama_status = "not installed (make bench-peers)" if gguf is not None else f"no GGUF found for {model}"
        print(f"[spec] llama.cpp {llama_status}; its rows skipped", file=sys.stderr, flush=True)
    if not quick:
        for delay in DELAYS:   # windows pipelined (depth 3, the default), and at 20 ms one at a time too
            for depth in (None, 1) if delay == 20.0 else (None,):
                label = f"3 stages, {delay:g} ms/hop" + (", depth 1" if depth == 1 else "")
                got, _ = run_pipeline_case(ours_model, tmp, 3, delay, on, [(label, "copy", work["copy"], 1)],
                                           new_tokens, work["copy"], depth)
                measured += got
        got, _ = run_pipeline_case(ours_model, tmp, 2, 0.0, on,
                                   [(f"2 stages, {STREAMS} streams", "copy", work["copy"][:STREAMS], STREAMS),
                                    (f"2 stages, {STREAMS} streams", "mixed", mixed, STREAMS)],
                                   new_tokens, work["copy"] + work["chat"])
        measured += got

    rows, acc, ident = measured_rows(measured, new_tokens)
    result: dict[str, Any] = {
        "settings": {"model": str(model), "stage_model": str(ours_model), "weights": weights,
                     "gguf": str(gguf) if gguf else None, "new_tokens": new_tokens, "greedy": True,
                     "ignore_eos": True, "quick": quick, "device": args.device, "dtype": args.dtype,
                     "llama_threads": LLAMA_THREADS, "lookup_num_pred_tokens": list(LOOKUP),
                     "prompt_tokens": {w: [len(p) for p in ps] for w, ps in work.items()}},
        "speculation": {"available": spec_used is not None, "topology": spec_used},
        "llama_cpp": llama_status, "rows": rows, "acceptance": acc, "identity": ident,
        "runs": [{"engine": m.engine, "config": m.config, "workload": m.workload,
                  "off": [{k: r.get(k) for k in ("n", "decode_s", "ttft_s", "spec", "tokens")} for r in m.off],
                  "on": [{k: r.get(k) for k in ("n", "decode_s", "ttft_s", "spec", "tokens")} for r in m.on]}
                 for m in measured],
    }
    result["goals"] = spec_goal_rows(result)
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    text = spec_tables(result)
    tables.extend(text)
    write_report(args.out, "spec", "skippy_zmq speculative decoding (bench spec)", result, text)
    return result


def spec_tables(result: dict[str, Any]) -> list[str]:
    s = result["settings"]
    live = result["speculation"]["available"]
    where = (f"SmolLM2-135M-Instruct, ours {s['weights']} on {s['device']} {s['dtype']}, llama.cpp "
             f"{Path(s['gguf']).name if s['gguf'] else 'n/a'} on {s['llama_threads']} threads; "
             f"{s['new_tokens']} new tokens per prompt, greedy, ignore_eos")
    drafting = (f"driver.speculative = {json.dumps(result['speculation']['topology'])}" if live else
                "speculation is not in this build: the 'on' rows decode plainly")
    return [
        print_table("speculative decoding: goals (every figure from this run)", result["goals"]),
        print_table(f"speculative decoding, side by side ({where})", table_rows(result["rows"]),
                    "decode_tok_s = tokens after the first / first-to-last-token time, summed over the prompts "
                    "(one after another; concurrent rows: all streams' tokens over the window from the first "
                    "stream's first token to the last stream's last, steady = while every stream decodes, as "
                    "bench pipeline); median_tok_s = the median prompt's (stream's) own figure; ratio_to_off = on "
                    "÷ off of the same engine and configuration (llama.cpp: ÷ plain). Ours: off and on on the same "
                    "pipeline, interleaved prompt by prompt, off = GenRequest(speculative=False); " + drafting +
                    ". identical = prompts whose tokens on equal off's. llama.cpp: Llama(draft_model="
                    "LlamaPromptLookupDecoding(num_pred_tokens=N)), max_ngram_size 2."),
        print_table("speculative decoding: acceptance (from each request's final event)", result["acceptance"],
                    "acceptance = accepted ÷ drafted tokens; accepted_per_step = accepted drafts per verify window "
                    "(each window also yields the target's own next token)."),
        print_table("speculative decoding: greedy identity, on vs off", [
            {k: i[k] for k in ("engine", "config", "workload", "identical", "against", "first_mismatch")}
            for i in result["identity"]],
            "first_mismatch: prompt index -> leading tokens equal before the first difference."),
    ]
