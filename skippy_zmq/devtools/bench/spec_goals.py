"""bench spec's arithmetic (pure, tested in tests/test_bench.py): speculation counts, acceptance,
decode speeds, greedy identity, and the issue's goals read from one run's rows."""

from __future__ import annotations

import statistics
from typing import Any

from skippy_zmq.devtools.bench.goals import _ratio, _row
from skippy_zmq.devtools.bench.greedy import first_mismatch
from skippy_zmq.devtools.bench.pipeline import steady_tok_s

LOOKUP = (2, 10)                # LlamaPromptLookupDecoding(num_pred_tokens=...)
STREAMS = 8                     # concurrent streams on 2 stages


def spec_counts(stats: dict[str, Any] | None) -> dict[str, int] | None:
    """{windows, drafted, accepted} from a final event's stats, or None when speculation did not run."""
    got = (stats or {}).get("speculative")
    if not isinstance(got, dict):
        return None
    try:
        return {k: int(got.get(k) or 0) for k in ("windows", "drafted", "accepted")}
    except (TypeError, ValueError):
        return None


def acceptance(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Summed drafted / accepted / windows over runs; rate = accepted / drafted, per step = accepted / windows."""
    counted = [r["spec"] for r in runs if r.get("spec")]
    if not counted:
        return {"windows": None, "drafted": None, "accepted": None, "acceptance": None, "accepted_per_step": None}
    w, d, a = (sum(c[k] for c in counted) for k in ("windows", "drafted", "accepted"))
    return {"windows": w, "drafted": d, "accepted": a, "acceptance": round(a / d, 3) if d else None,
            "accepted_per_step": round(a / w, 2) if w else None}


def decode_speed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate decode tok/s (tokens after the first, summed, over the decode time, summed) and the
    median of the per-prompt figures."""
    timed = [r for r in runs if r["decode_s"] > 0 and r["n"] > 1]
    if not timed:
        return {"decode_tok_s": None, "median_tok_s": None}
    tokens, seconds = sum(r["n"] - 1 for r in timed), sum(r["decode_s"] for r in timed)
    return {"decode_tok_s": round(tokens / seconds, 1),
            "median_tok_s": round(statistics.median((r["n"] - 1) / r["decode_s"] for r in timed), 1)}


def concurrent_speed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Concurrent streams: tokens after each stream's first over the window from the first stream's first
    token to the last stream's last (what finishing the batch took), the steady figure of bench pipeline
    (while every stream decodes), and the median stream's own tok/s."""
    stamps = [r["stamps"] for r in runs if len(r["stamps"]) > 1]
    if not stamps:
        return {"decode_tok_s": None, "steady_tok_s": None, "median_tok_s": None}
    window = max(s[-1] for s in stamps) - min(s[0] for s in stamps)
    tokens = sum(len(s) - 1 for s in stamps)
    return {"decode_tok_s": round(tokens / window, 1) if window > 0 else None,
            "steady_tok_s": steady_tok_s(stamps),
            "median_tok_s": decode_speed(runs)["median_tok_s"]}


def identity(off: list[list[int]], on: list[list[int]]) -> dict[str, Any]:
    """How many prompts gave the very same tokens; the first differing index of each that did not."""
    same = sum(a == b for a, b in zip(off, on))
    return {"identical": f"{same}/{len(off)}", "identical_count": same, "prompts": len(off),
            "first_mismatch": {i: first_mismatch(b, a) for i, (a, b) in enumerate(zip(off, on)) if a != b}}


def spec_goal_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals from one run's rows (bench spec's JSON). Met is n/a without speculation in the
    build (on then decodes like off) and for goals whose inputs the run lacks."""
    rows = {(r["engine"], r["config"], r["workload"], r["speculation"]): r for r in result.get("rows", [])}
    live = bool(result.get("speculation", {}).get("available"))

    def tok(engine: str, config: str, workload: str, spec: str) -> float | None:
        r = rows.get((engine, config, workload, spec))
        return r.get("decode_tok_s") if r else None

    def goal(metric: str, goal_text: str, a: float | None, b: float | None, bound: float, detail: str
             ) -> dict[str, Any]:
        v = _ratio(a, b)
        met = None if v is None or not live else v >= bound
        return _row(metric, goal_text, v, met, f"{a} vs {b} tok/s; {detail}" +
                    ("" if live else "; speculation not in this build (on = off)"))

    ident = [i for i in result.get("identity", []) if i["engine"] == "ours"]
    same, total = sum(i["identical_count"] for i in ident), sum(i["prompts"] for i in ident)
    out = [_row("greedy tokens, speculation on vs off (every configuration below)", "identical",
                f"{same}/{total}" if total else None, (same == total) if total and live else None,
                "; ".join(f"{i['workload']} {i['config']}: {i['identical']}" for i in ident))]
    one = "1 stage"
    best = max(((n, tok("llama.cpp", f"prompt lookup {n}", "copy", "on")) for n in LOOKUP),
               key=lambda kv: kv[1] or 0, default=(None, None))
    out.append(goal("copy, 1 stream, 1 stage: on ÷ off", "≥ 2.0", tok("ours", one, "copy", "on"),
                    tok("ours", one, "copy", "off"), 2.0, "aggregate decode tok/s"))
    out.append(goal("copy, 1 stream, 1 stage: ours on ÷ llama.cpp prompt lookup (best of 2, 10)", "≥ 1.0",
                    tok("ours", one, "copy", "on"), best[1], 1.0,
                    f"best: num_pred_tokens={best[0]}"))
    three = "3 stages, 20 ms/hop"
    out.append(goal("copy, 1 stream, 3 stages, 20 ms per hop: on ÷ off", "≥ 2.5", tok("ours", three, "copy", "on"),
                    tok("ours", three, "copy", "off"), 2.5, "aggregate decode tok/s"))
    out.append(goal("copy, 1 stream, 3 stages, 20 ms per hop: pipelined windows (depth 3) ÷ one at a time",
                    "≥ 1.8", tok("ours", three, "copy", "on"), tok("ours", three + ", depth 1", "copy", "on"), 1.8,
                    "speculation on in both; depth 1 = a window goes down and back before the next"))
    out.append(goal("chat, 1 stream, 1 stage: on ÷ off", "≥ 0.97", tok("ours", one, "chat", "on"),
                    tok("ours", one, "chat", "off"), 0.97, "aggregate decode tok/s"))
    many = f"2 stages, {STREAMS} streams"
    out.append(goal(f"{STREAMS} streams, 2 stages, aggregate: on ÷ off", "≥ 1.0", tok("ours", many, "mixed", "on"),
                    tok("ours", many, "mixed", "off"), 1.0, "mixed: 4 copy + 4 chat streams"))
    out.append(_row("seeded sampling, on vs off and across a resume", "identical", None, None,
                    "not measured by bench spec (greedy only here)"))
    return out
