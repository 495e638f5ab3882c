"""The performance goals, each read from one `bench all` run's results (bench.json).

Every figure is a ratio of numbers measured side by side in the same run;
a goal whose inputs the run lacks (e.g. llama.cpp not installed, a suite not
run) says so instead of quoting a number from elsewhere.
"""

from __future__ import annotations

from typing import Any

MISSING = None


def _get(result: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return MISSING
        result = result[key]
    return result


def _row(metric: str, goal: str, value: float | None, met: bool | None, detail: str) -> dict[str, Any]:
    return {"metric": metric, "goal": goal, "measured": value,
            "met": "n/a" if met is None else ("yes" if met else "**no**"), "detail": detail}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def goal_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    llama = _get(result, "peers", "llama_cpp", "decode_tok_s")
    singles = {w: _get(result, key, "decode_tok_s") for w, key in
               (("f32", "single"), ("int8", "single_int8"), ("q4", "single_q4"))}
    best = max(((w, v) for w, v in singles.items() if v), key=lambda kv: kv[1], default=(None, None))
    r = _ratio(best[1], llama)
    rows.append(_row("single-stream decode, 1 stage ÷ llama.cpp", "≥ 1.0", r, None if r is None else r >= 1.0,
                     f"best of ours: {best[0]} {best[1]} tok/s; llama.cpp {llama} tok/s; all: " +
                     ", ".join(f"{w} {v}" for w, v in singles.items())))
    one = {o["stages"]: o for o in _get(result, "pipeline", "one_stream") or []}
    for s in (2, 3):
        v = _get(one, s, "ratio_to_1_stage") if s in one else None
        rows.append(_row(f"{s}-stage ÷ 1-stage, 1 stream", "≥ 0.93", v, None if v is None else v >= 0.93,
                         f"{_get(one, s, 'decode_tok_s') if s in one else None} vs "
                         f"{_get(one, 1, 'decode_tok_s') if 1 in one else None} tok/s"))
    hops = [o["per_hop_overhead_us"] for o in one.values() if o.get("per_hop_overhead_us") is not None]
    worst = max(hops) / 1000 if hops else None
    rows.append(_row("per-hop overhead, loopback (ms)", "≤ 0.5", round(worst, 3) if worst is not None else None,
                     None if worst is None else worst <= 0.5,
                     "(1/tok_s(S) - 1/tok_s(1)) / (S - 1), worst stage count; breakdown in the per-hop table"))
    sweep = {(r_["stages"], r_["streams"]): r_["agg_tok_s"] for r_ in _get(result, "pipeline", "rows") or []}
    conc = {r["engine"]: r["agg_tok_s"] for r in _get(result, "peers", "concurrency") or [] if r.get("streams") == 8}
    ours8, np8 = conc.get("skippy_zmq q4, 2 stage(s)"), conc.get("llama-server -np 8")
    v = _ratio(ours8, np8)
    rows.append(_row("aggregate decode, 8 streams, 2 stages ÷ llama-server -np 8", "≥ 1.0", v,
                     None if v is None else v >= 1.0, f"{ours8} vs {np8} tok/s (bench peers' concurrency table)"))
    for s in (1, 2, 3):
        a8, a16 = sweep.get((s, 8)), sweep.get((s, 16))
        ok = None if a8 is None or a16 is None else a16 >= a8
        rows.append(_row(f"aggregate at 16 streams ≥ at 8, {s} stage(s)", "16 ≥ 8", _ratio(a16, a8), ok,
                         f"{a16} vs {a8} tok/s"))
    ttft = {t["prefix_tokens"]: t for t in _get(result, "prefix", "ttft") or []}
    v = _get(ttft, 1024, "warm_over_cold") if 1024 in ttft else None
    rows.append(_row("warm ÷ cold TTFT, 1024-token shared prefix", "≤ 0.05", v, None if v is None else v <= 0.05,
                     f"{_get(ttft, 1024, 'warm_ttft_ms') if 1024 in ttft else None} vs "
                     f"{_get(ttft, 1024, 'cold_ttft_ms') if 1024 in ttft else None} ms"))
    v = _get(result, "prefix", "zero_hit", "overhead")
    rows.append(_row("0%-hit overhead of the prefix cache", "≤ 2%", v, None if v is None else v <= 0.02,
                     "1 - requests/s with the cache on ÷ off"))
    return rows
