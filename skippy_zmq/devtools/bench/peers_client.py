"""bench peers' client, the same code for both engines (ours and llama-server): streamed greedy
/v1/completions over token ids, with arrival times taken on the client."""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from skippy_zmq.devtools.bench.pipeline import percentile


@dataclass
class Streamed:
    start: float
    first: float | None = None       # first token's arrival
    end: float = 0.0
    tokens: int = 0                  # completion tokens (the usage, else the chunks)
    text: str = ""
    arrivals: list[float] = field(default_factory=list)   # one per chunk that carried text
    error: str | None = None

    @property
    def decode_tok_s(self) -> float | None:
        if self.first is None or self.tokens < 2 or self.end <= self.first:
            return None
        return (self.tokens - 1) / (self.end - self.first)


def stream_completion(base: str, prompt: list[int], max_tokens: int, extra: dict[str, Any] | None = None,
                      timeout: float = 600.0) -> Streamed:
    """One streamed greedy /v1/completions request over token ids; arrival times on the client."""
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **(extra or {})}
    got = Streamed(start=time.perf_counter())
    usage = None
    try:
        with httpx.stream("POST", base + "/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                got.error = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                return got
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                piece = "".join(c.get("text") or "" for c in event.get("choices") or [])
                if piece:
                    now = time.perf_counter()
                    got.first = got.first or now
                    got.arrivals.append(now)
                    got.text += piece
    except (httpx.HTTPError, ValueError) as exc:
        got.error = f"{type(exc).__name__}: {exc}"
    got.end = got.arrivals[-1] if got.arrivals else time.perf_counter()
    got.tokens = int((usage or {}).get("completion_tokens") or len(got.arrivals))
    return got


def run_together(base: str, prompts: list[list[int]], max_tokens: int, extra: dict[str, Any] | None = None
                 ) -> tuple[list[Streamed], float]:
    """All prompts at once, one thread each; (results, wall seconds)."""
    out: list[Streamed | None] = [None] * len(prompts)

    def one(i: int) -> None:
        out[i] = stream_completion(base, prompts[i], max_tokens, extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [o for o in out if o is not None], time.perf_counter() - t0


def _check(results: list[Streamed], what: str) -> None:
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} request(s) failed, first: {bad[0]}")


def single_stream(base: str, prompts: list[list[int]], new_tokens: int, extra: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """Each prompt alone, one after another: medians of prefill and decode tok/s, and the texts."""
    return _summary(prompts, [stream_completion(base, p, new_tokens, extra) for p in prompts])


def interleaved_streams(engines: list[tuple[str, dict[str, Any] | None]], prompts: list[list[int]],
                        new_tokens: int) -> list[dict[str, Any]]:
    """single_stream for each of `engines` ((base URL, extra request fields); all serving at once), taking
    turns prompt by prompt: every engine meets the same stretches of a shared machine's load, as far as
    one stream at a time can. One summary per engine, in order."""
    runs: list[list[Streamed]] = [[] for _ in engines]
    for prompt in prompts:
        for (base, extra), got in zip(engines, runs):
            got.append(stream_completion(base, prompt, new_tokens, extra))
    return [_summary(prompts, got) for got in runs]


def _summary(prompts: list[list[int]], runs: list[Streamed]) -> dict[str, Any]:
    _check(runs, "single stream")
    return {"prefill_tok_s": round(statistics.median(len(p) / (r.first - r.start) for p, r in zip(prompts, runs)), 1),
            "decode_tok_s": round(statistics.median(r.decode_tok_s or 0.0 for r in runs), 2),
            "e2e_tok_s": round(sum(r.tokens for r in runs) / sum(r.end - r.start for r in runs), 2),
            "texts": [r.text for r in runs], "tokens": [r.tokens for r in runs]}


def concurrent(base: str, prompts: list[list[int]], new_tokens: int, extra: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """All at once: aggregate tok/s (every completion token over the wall time) and the time between
    a stream's tokens (p50/p99 over every stream)."""
    runs, wall = run_together(base, prompts, new_tokens, extra)
    _check(runs, f"{len(prompts)} streams")
    gaps = sorted(b - a for r in runs for a, b in zip(r.arrivals, r.arrivals[1:])) or [0.0]
    return {"streams": len(prompts), "agg_tok_s": round(sum(r.tokens for r in runs) / wall, 1),
            "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 1), "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 1)}

