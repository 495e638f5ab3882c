"""Pipeline benchmarks: 1/2/3 stage processes on loopback (`--stages`), the
driver's PipelineEngine in this process, every stage on `--device` in `--dtype`.

Reports, per stage count: single-stream decode tok/s, its ratio to 1 stage and
the per-hop overhead it implies; activation bytes per token per hop for each
wire dtype; a concurrency sweep up to 32 streams (aggregate tok/s, inter-token
latency and the pipeline bubble of every stage); and, off cpu/float32, the
pipeline's greedy tokens against one CPU fp32 process (bench/greedy.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from skippy_zmq.protocol import wire
from skippy_zmq.devtools.bench import greedy
from skippy_zmq.devtools.bench.common import print_table, stage_overrides, synthetic_prompt
from skippy_zmq.engine.request import EngineError, GenRequest
from skippy_zmq.devtools.harness import running_pipeline, write_topology

LANES = 32   # kv_lanes and driver max_sessions, so 32 streams run at once (stage_buckets: rows up to 32)
STREAMS = (1, 2, 4, 8, 16, 32)
QUICK_STREAMS = (1, 4, 16)
# write_topology overrides for every benchmark pipeline. dead_after_s is raised because a stage
# compiling a new bucket on a busy 2-core machine can miss the 2 s default and drop its sessions;
# request_timeout_s because 32 streams on such a machine (or in bfloat16 on a CPU) outlast 120 s.
BENCH_TOPOLOGY: dict[str, Any] = {"kv_lanes": LANES, "driver__max_sessions": LANES, "driver__dead_after_s": 30.0,
                                  "driver__request_timeout_s": 600.0}


# ---------------------------------------------------------------- pure arithmetic (tests/test_bench.py)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in [0, 1])."""
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def stage_busy_ms(traces: Iterable[list[dict[str, Any]]]) -> dict[str, float]:
    """Sum of compute_ms per stage over traces that each appear once (one per reply message)."""
    busy: dict[str, float] = {}
    for trace in traces:
        for hop in trace:
            busy[hop["stage"]] = busy.get(hop["stage"], 0.0) + float(hop["compute_ms"])
    return busy


def bubble(traces: Iterable[list[dict[str, Any]]], wall_s: float, stage_ids: Iterable[str]) -> dict[str, float]:
    """Per stage, the fraction of the window it sat idle: 1 - compute / wall, clamped to [0, 1]
    (a step that began just before the window can push compute a hair past it)."""
    busy = stage_busy_ms(traces)
    return {s: round(min(1.0, max(0.0, 1 - busy.get(s, 0.0) / (1000 * wall_s))), 3) for s in stage_ids}


def per_hop_overhead_us(tok_s_one_stage: float, tok_s: float, stages: int) -> float | None:
    """Extra time per token per inter-stage hop: (1/tok_s(S) - 1/tok_s(1)) / (S - 1), in µs."""
    if stages < 2 or tok_s <= 0 or tok_s_one_stage <= 0:
        return None
    return round(1e6 * (1 / tok_s - 1 / tok_s_one_stage) / (stages - 1), 1)


def steady_tok_s(stamps: list[list[float]]) -> float:
    """Aggregate decode tok/s while every stream is decoding: tokens stamped between the last stream's
    first token and the first stream's last token, over that window. Streams start staggered (their
    prompts are prefilled a few chunks at a time), so dividing all tokens by the longest stream's
    decode time would charge the staggered start and finish to throughput. Falls back to that when
    the streams never all decode at once."""
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    inside = sum(1 for s in stamps for t in s if start < t <= end)
    if end - start > 0 and inside >= 2 * len(stamps):
        return round(inside / (end - start), 1)
    tokens = sum(len(s) - 1 for s in stamps)
    return round(tokens / max(s[-1] - s[0] for s in stamps), 1)


def wire_rows(width: int, stage_counts: Iterable[int] = (2, 3)) -> list[dict[str, Any]]:
    """Activation bytes per decoded token: per hop, and over the S - 1 hops of each stage count."""
    rows = []
    for dtype in (wire.WireDType.F32, wire.WireDType.F16, wire.WireDType.BF16, wire.WireDType.Q8):
        per_hop = wire.bytes_per_token(dtype, width)
        row: dict[str, Any] = {"wire_dtype": dtype.label, "bytes_per_token_per_hop": per_hop}
        row.update({f"bytes_per_token_{s}_stages": per_hop * (s - 1) for s in stage_counts})
        rows.append(row)
    return rows


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def hop_breakdown(traces: list[list[dict[str, Any]]], encode_ms: dict[str, float | None]) -> list[dict[str, Any]]:
    """Where each inter-stage hop's time goes, from the stages' own telemetry (one trace per decode step).

    Per stage k -> k+1: encode (stage k's mean wire encode + hand-off to ZeroMQ, from its heartbeat
    counters), send->recv (k+1's receive wall clock minus k's send wall clock, less that encode), decode
    (k+1's wire decode); then k+1's host->device, compute, device->host (when the runner reports them)
    and, on the last stage, sampling. Medians over the steps.
    """
    if not traces:
        return []
    stages = [hop["stage"] for hop in traces[0]]
    steps = [t for t in traces if [hop["stage"] for hop in t] == stages]

    def col(key: str, j: int) -> float | None:
        return _median([float(t[j][key]) for t in steps if key in t[j]])

    rows = []
    for i in range(len(stages) - 1):
        enc = encode_ms.get(stages[i]) or 0.0
        transit = [(t[i + 1]["recv_ns"] - t[i]["send_ns"]) / 1e6 - enc for t in steps
                   if "send_ns" in t[i] and "recv_ns" in t[i + 1]]
        rows.append({"hop": f"{stages[i]}->{stages[i + 1]}", "encode_ms": round(enc, 3),
                     "send_to_recv_ms": _median(transit), "decode_ms": col("decode_ms", i + 1),
                     "h2d_ms": col("h2d_ms", i + 1), "compute_ms": col("compute_ms", i + 1),
                     "d2h_ms": col("d2h_ms", i + 1),
                     "sample_ms": col("sample_ms", i + 1) if i == len(stages) - 2 else None})
    return rows


def encode_ms_per_stage(engine: Any) -> dict[str, float | None]:
    """Mean encode + hand-off per forwarded message, from each stage's heartbeat counters."""
    out: dict[str, float | None] = {}
    for sid, state in engine.stages.items():
        n = state.info.get("forwarded", 0)
        out[sid] = round(state.info.get("encode_send_us", 0) / n / 1000, 3) if n else None
    return out


# ---------------------------------------------------------------- measurement


class TraceLog:
    """Every reply that carries a per-stage trace, recorded once per message as the driver receives it.

    Token events repeat their batch's trace on every row, so summing event traces would count a
    batched step once per row; the reply hook sees each PREDICTED_TOKENS (and prefill ACK) exactly once.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[float, bool, list[dict[str, Any]]]] = []   # (when, decode step?, trace)

    def __call__(self, _stage_id: str, msg: wire.Message) -> None:
        trace = msg.extras.get("trace") or msg.extras.get("stats", {}).get("trace")
        if trace:
            self.entries.append((time.perf_counter(), msg.kind == wire.Kind.PREDICTED_TOKENS, trace))

    def window(self, t0: float, t1: float, steps_only: bool = False) -> list[list[dict[str, Any]]]:
        return [trace for t, step, trace in list(self.entries) if t0 <= t <= t1 and (step or not steps_only)]


def hop_medians(traces: list[list[dict[str, Any]]], ids: Sequence[str]) -> dict[str, Any] | None:
    """Where one-stream decode steps went, medians in ms over the traces (in the order the steps ran)
    that cross exactly the stages `ids` with their receive and send times: each stage's `compute`
    (its runner call) and `own` software (receive to send less compute), the `transit` between
    stages (send to the next one's receive: encode, wire, wake-up), `inside` (receive to send summed
    over the stages) and the `round` from the last stage's send to the first stage's receive of the
    next step (the driver's turn and its two hops; None with fewer than two steps). None: no such trace."""
    steps = [t for t in traces if [h.get("stage") for h in t] == list(ids) and
             all("recv_ns" in h and "send_ns" in h for h in t)]
    if not steps:
        return None
    med = statistics.median
    rounds = [(b[0]["recv_ns"] - a[-1]["send_ns"]) / 1e6 for a, b in zip(steps, steps[1:])
              if b[0]["recv_ns"] > a[-1]["send_ns"]]
    return {"compute": [med(float(t[i]["compute_ms"]) for t in steps) for i in range(len(ids))],
            "own": [med((t[i]["send_ns"] - t[i]["recv_ns"]) / 1e6 - float(t[i]["compute_ms"]) for t in steps)
                    for i in range(len(ids))],
            "transit": [med((t[i + 1]["recv_ns"] - t[i]["send_ns"]) / 1e6 for t in steps) for i in range(len(ids) - 1)],
            "inside": med(sum((h["send_ns"] - h["recv_ns"]) / 1e6 for h in t) for t in steps),
            "round": med(rounds) if rounds else None}


def step_compute_ms(traces: list[list[dict[str, Any]]]) -> float | None:
    """Median compute of one decode step summed over every stage (one trace per step)."""
    sums = [sum(float(hop["compute_ms"]) for hop in trace) for trace in traces]
    return round(statistics.median(sums), 2) if sums else None


def run_stream(engine: Any, ids: list[int], new_tokens: int, out: list[dict[str, Any]],
               errors: list[str]) -> None:
    stamps = []
    t0 = time.perf_counter()
    try:
        for event in engine.generate_blocking(GenRequest("bench", tuple(ids), max_tokens=new_tokens,
                                                         ignore_eos=True)):
            if event.token_id is not None:
                stamps.append(time.perf_counter())
    except EngineError as exc:
        errors.append(exc.message)
        return
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    out.append({"ttft_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0], "tokens": len(stamps),
                "gaps": gaps, "stamps": stamps})


def measure(engine: Any, prompts: list[list[int]], new_tokens: int, log: TraceLog | None = None,
            stage_ids: tuple[str, ...] = (), strict: bool = True) -> dict[str, Any]:
    """Run len(prompts) concurrent streams; aggregate decode tok/s, inter-token latency, bubble.

    A failed stream raises unless `strict` is off (warm-up runs), which then returns {}."""
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    threads = [threading.Thread(target=run_stream, args=(engine, p, new_tokens, results, errors)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1 = time.perf_counter()
    if errors:
        if not strict:
            return {}
        raise RuntimeError(f"{len(errors)} of {len(prompts)} streams failed: {errors[0]}")
    gaps = sorted(g for r in results for g in r["gaps"])
    out = {"streams": len(prompts), "agg_tok_s": steady_tok_s([r["stamps"] for r in results]),
           "per_stream_tok_s": round(statistics.median((r["tokens"] - 1) / r["decode_s"] for r in results), 1),
           "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 2),
           "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 2),
           "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in results), 1),
           "wall_s": round(t1 - t0, 2)}
    if log is not None:
        out["bubble"] = bubble(log.window(t0, t1), t1 - t0, stage_ids)
        steps = log.window(t0, t1, steps_only=True)
        out["step_compute_ms"] = step_compute_ms(steps)
        if len(prompts) == 1 and len(stage_ids) > 1:
            out["hops"] = hop_breakdown(steps, encode_ms_per_stage(engine))
    return out


def stream_prompts(base: list[int], streams: int, salt: int = 0) -> list[list[int]]:
    """Distinct prompts of the same length: no prefix shared between streams, nor with another salt's."""
    return [[(t + k) % 1000 + 200 for t in base] if k else base for k in range(salt, salt + streams)]


def sweep(engine: Any, topology: Any, tokenizer: Any, streams: tuple[int, ...], new_tokens: int,
          prompt_len: int) -> list[dict[str, Any]]:
    log = TraceLog()
    engine.on_reply_hooks.append(log)
    stage_ids = tuple(s.id for s in topology.stages)
    base = synthetic_prompt(tokenizer, prompt_len)
    rows = []
    for s in streams:
        # Untimed first: batches ramp through the row buckets up to s (positions stay in the first
        # attention bucket), so nothing compiles inside the timing.
        measure(engine, stream_prompts(base, s, salt=100), 4, strict=False)
        m = measure(engine, stream_prompts(base, s), new_tokens, log, stage_ids)
        m["stages"] = len(stage_ids)
        rows.append(m)
    return rows


def one_stream_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Single-stream decode per stage count, against the 1-stage row (none without one: `--stages 2`)."""
    tok_s = [1000 / r["itl_p50_ms"] for r in rows]
    one = next((t for r, t in zip(rows, tok_s) if r["stages"] == 1), 0.0)
    return [{"stages": r["stages"], "decode_tok_s": round(t, 1), "ms_per_token": r["itl_p50_ms"],
             "ratio_to_1_stage": round(t / one, 3) if one else None,
             "per_hop_overhead_us": per_hop_overhead_us(one, t, r["stages"])} for r, t in zip(rows, tok_s)]


def model_width(model: Path) -> int:
    return int(json.loads((model / "model.json").read_text())["d_model"])


def bench_pipeline(args: argparse.Namespace, tables: list[str], prior: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    streams = QUICK_STREAMS if args.quick else STREAMS
    new_tokens = 16 if args.quick else 64
    prompt_len = 64
    model = Path(args.model).absolute()
    tmp = Path(tempfile.mkdtemp(prefix="skippy-bench-"))
    # Off the tested setting (cpu, float32), check the tokens too: CPU reference first, before any stage runs.
    check = (args.device, args.dtype) != ("cpu", "float32")
    prompts, want = greedy.cpu_reference(model) if check else ([], [])
    rows: list[dict[str, Any]] = []
    agreement: list[dict[str, Any]] = []
    for n in args.stages:
        path = write_topology(tmp, model, n, name=f"bench-{n}", **BENCH_TOPOLOGY, **stage_overrides(args))
        with running_pipeline(path, tmp / f"run-{n}", warm=True) as (engine, tokenizer, topology, _procs):
            if check:
                got = greedy.pipeline_tokens(engine, prompts)
                agreement.append(dict(greedy.agreement_row(n, got, want), tokens=got))
            rows += sweep(engine, topology, tokenizer, streams, new_tokens, prompt_len)
    peer = ((prior or {}).get("peers") or {}).get("llama_cpp") or {}
    one_stream = one_stream_rows([r for r in rows if r["streams"] == 1])
    wires = wire_rows(model_width(model))
    sweep_rows = [{"stages": r["stages"], "streams": r["streams"], "agg_tok_s": r["agg_tok_s"],
                   "per_stream_tok_s": r["per_stream_tok_s"], "itl_p50_ms": r["itl_p50_ms"],
                   "itl_p99_ms": r["itl_p99_ms"], "ttft_ms": r["ttft_ms"],
                   "bubble_per_stage": " / ".join(f"{v:.2f}" for v in r["bubble"].values()),
                   **({"ratio_to_llama_cpp": round(r["agg_tok_s"] / peer["decode_tok_s"], 2)} if peer else {})}
                  for r in rows]
    on = f"{args.device}, {args.dtype}, {args.weights or 'f32'} weights"
    tables.append(print_table(
        f"pipeline, 1 stream ({on}, {new_tokens} new tokens, {prompt_len}-token prompt, f32 wire)", one_stream,
        "decode_tok_s = 1000 / median inter-token ms (robust to a neighbour's CPU burst); "
        "per_hop_overhead_us = (1/tok_s(S) - 1/tok_s(1)) / (S - 1): what each inter-stage hop "
        "(encode, ZeroMQ over loopback, decode, the next process waking) adds to every token."))
    hops = [dict(h, stages=r["stages"]) for r in rows if r["streams"] == 1 for h in r.get("hops", [])]
    if hops:
        tables.append(print_table(
            f"per-hop breakdown, 1 stream ({on}; medians over the decode steps, ms)", hops,
            "From the stages' own telemetry: encode = wire encode + hand-off to ZeroMQ at the sender; "
            "send_to_recv = receiver's arrival wall clock - sender's send wall clock - encode (ZeroMQ I/O "
            "threads, loopback, the receiver's poll wake-up); decode = wire decode at the receiver; then the "
            "receiver's host->device, compute, device->host and (last stage) sampling."))
    tables.append(print_table(
        f"activation bytes per token (width {model_width(model)}; `wire.activation_dtype`)", wires,
        "Each decode step forwards one row per session over each of the S - 1 inter-stage hops; "
        "the return hop carries only the sampled token id."))
    tables.append(print_table(
        f"concurrency ({on}, decode, {new_tokens} new tokens per stream, {prompt_len}-token prompts)", sweep_rows,
        "bubble = 1 - (the stage's compute_ms summed over the window, one trace per reply) / wall time of "
        "the window, per stage s0 / s1 / s2: the fraction of the time work was in flight that the stage sat idle."))
    if check:
        tables.append(print_table(
            f"greedy tokens, pipeline on {on} vs one process on cpu, float32 ({greedy.N_TOKENS} tokens per prompt)",
            [{k: v for k, v in r.items() if k != "tokens"} for r in agreement],
            "first_mismatch = leading tokens equal to the CPU's, per prompt; bfloat16 may part on a near-tie."))
    return {"device": args.device, "dtype": args.dtype, "new_tokens": new_tokens, "prompt_tokens": prompt_len,
            "one_stream": one_stream, "wire": wires, "rows": rows,
            **({"greedy_vs_cpu": {"cpu_tokens": want, "stages": agreement}} if check else {})}
