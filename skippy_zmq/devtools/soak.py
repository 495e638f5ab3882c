"""Soak benchmark: N streaming chat clients against a pipeline for M minutes.

    python -m skippy_zmq.devtools.soak --topology topologies/smollm2-2stage.yaml --streams 16 --minutes 10
    python -m skippy_zmq.devtools.soak --url http://127.0.0.1:8000/v1 --run-dir runs/two --minutes 10

With --topology the stages and the driver are launched into a run directory
(as scripts/launch.sh does) and stopped at the end (as scripts/stop.sh does);
with --url an already running server is used, and --run-dir, if given, names
its pid files. The clients start once every stage has finished its idle
warm-up compiles (skippy_stage_warmups_pending), so compiles are not counted as
growth. Every client loops over requests (the official `openai` client) until
the time is up; each request is bounded by max_tokens and a client timeout, so
the run ends within one request of the deadline. Recorded: tokens/s and errors
per minute, the RSS of every process named by RUN_DIR/*.pid and each stage's
prefix-store bytes (the driver's /metrics; the store fills up to its
cache.max_bytes, which is growth by design) every --sample-s seconds. At the end: a table,
soak.json and soak.md in --out, and a verdict: zero errors, and memory flat
after warm-up (mean RSS over the last minute within --flat-pct of the mean
over the first minute after warm-up). Warm-up lasts --warmup-minutes (2) or until
every stage's prefix store has stopped filling, whichever is later.

--mix names the kinds of request the clients take turns at (client i's n-th
request is kind (i + n) mod the count): "plain" (the default: a streamed chat at
--temperature), "json-schema" (a strict json_schema chat), "tool-call" (a forced
function call), "n2" (two seeded sampled choices), "logprobs" (greedy, logprobs 2
with echo) and "copy" (a greedy streamed chat whose answer repeats its prompt, so
speculation drafts), or "all". Every answer is checked for its kind's shape (the
JSON parses to the schema's keys, the call names the function with parseable
arguments, two choices, a logprob for every prompt and completion token after
the first); a malformed answer counts as an error.

A benchmark, not a test: it only measures and reports (exit code 1 when the
verdict fails).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from skippy_zmq.devtools.bench.common import format_table
from skippy_zmq.devtools.chaos import COPY_PROMPT
from skippy_zmq.devtools.chaos_requests import SCHEMA, SEED, WEATHER_TOOL

PROMPTS = ("Tell me a short story about a lighthouse keeper.", "Explain how rain forms, step by step.",
           "List some good names for a grey cat and say why.", "Describe the city of Lisbon to a child.",
           "Write a haiku about autumn, then explain it.", "What makes a good cup of tea?")
MAX_ERROR_SAMPLES = 50
# json-schema and tool-call answers end when their JSON closes; the bound only stops a runaway answer
CONSTRAINED_MAX_TOKENS = 128


# ---------------------------------------------------------------- recording


@dataclass
class MinuteTally:
    """Tokens, requests and errors per minute since `start`; thread-safe."""

    start: float
    tokens: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    requests: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))   # completed requests per kind
    error_samples: list[str] = field(default_factory=list)
    rss: list[dict[str, Any]] = field(default_factory=list)       # {"t": s, "rss_mb": {name: MB}}
    lock: threading.Lock = field(default_factory=threading.Lock)

    def minute(self) -> int:
        return int((time.monotonic() - self.start) // 60)

    def add_tokens(self, n: int) -> None:
        with self.lock:
            self.tokens[self.minute()] += n

    def finish_request(self, kind: str = "plain") -> None:
        with self.lock:
            self.requests[self.minute()] += 1
            self.by_kind[kind] += 1

    def error(self, message: str) -> None:
        with self.lock:
            self.errors[self.minute()] += 1
            if len(self.error_samples) < MAX_ERROR_SAMPLES:
                self.error_samples.append(f"{time.monotonic() - self.start:.1f}s {message}")

    def sample(self, rss_mb: dict[str, float], cache_mb: dict[str, float] | None = None) -> None:
        with self.lock:
            self.rss.append({"t": round(time.monotonic() - self.start, 1), "rss_mb": rss_mb,
                             "cache_mb": cache_mb or {}})


# ---------------------------------------------------------------- clients


class BadAnswer(RuntimeError):
    """An answer that came back but does not have its kind's shape."""


def _streamed_chat(client: Any, model: str, prompt: str, args: argparse.Namespace, rec: MinuteTally,
                   temperature: float) -> None:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
        temperature=temperature, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": args.ignore_eos})
    seen = total = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            seen += 1          # text chunks credit the minute they arrive in ...
            rec.add_tokens(1)
        if chunk.usage is not None:
            total = chunk.usage.completion_tokens
    if total <= 0:
        raise BadAnswer("stream ended without a usage chunk")
    rec.add_tokens(total - seen)   # ... and usage makes the total exact


def _plain(client: Any, model: str, prompt: str, args: argparse.Namespace, rec: MinuteTally) -> None:
    _streamed_chat(client, model, prompt, args, rec, args.temperature)


def _copy(client: Any, model: str, prompt: str, args: argparse.Namespace, rec: MinuteTally) -> None:
    _streamed_chat(client, model, f"{COPY_PROMPT} ({prompt})", args, rec, 0.0)


def _json_schema(client: Any, model: str, prompt: str, args: argparse.Namespace, rec: MinuteTally) -> None:
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Describe a planet as JSON. {prompt}"}],
        max_tokens=CONSTRAINED_MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "planet", "schema": SCHEMA, "strict": True}})
    text = resp.choices[0].message.content or ""
    try:
        value = json.loads(text)
    except ValueError:
        raise BadAnswer(f"json-schema: not JSON ({resp.choices[0].finish_reason}): {text[:120]!r}") from None
    if not isinstance(value, dict) or value.keys() != SCHEMA["properties"].keys():
        raise BadAnswer(f"json-schema: not the schema's keys: {value!r}"[:200])
    rec.add_tokens(resp.usage.completion_tokens)


def _tool_call(client: Any, model: str, prompt: str, args: argparse.Namespace, rec: MinuteTally) -> None:
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"What is the weather like? {prompt}"}],
        max_tokens=CONSTRAINED_MAX_TOKENS, temperature=0, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = resp.choices[0].message.tool_calls or []
    if [c.function.name for c in calls] != ["get_weather"]:
        raise BadAnswer(f"tool-call: calls {[c.function.name for c in calls]}, finish {resp.choices[0].finish_reason}")
    try:
        arguments = json.loads(calls[0].function.arguments)
    except ValueError:
        raise BadAnswer(f"tool-call: arguments not JSON: {calls[0].function.arguments[:120]!r}") from None
    if not isinstance(arguments, dict) or set(arguments) != {"city", "unit"}:
        raise BadAnswer(f"tool-call: arguments {arguments!r}"[:200])
    rec.add_tokens(resp.usage.completion_tokens)


def _n2(client: Any, model: str, prompt: str, args: argparse.Namespace, rec: MinuteTally) -> None:
    resp = client.completions.create(model=model, prompt=prompt, n=2, max_tokens=args.max_tokens,
                                     temperature=max(args.temperature, 0.5), seed=SEED,
                                     extra_body={"ignore_eos": args.ignore_eos})
    if sorted(c.index for c in resp.choices) != [0, 1]:
        raise BadAnswer(f"n2: choices {[c.index for c in resp.choices]}")
    rec.add_tokens(resp.usage.completion_tokens)


def _logprobs(client: Any, model: str, prompt: str, args: argparse.Namespace, rec: MinuteTally) -> None:
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
                                     logprobs=2, echo=True, extra_body={"ignore_eos": args.ignore_eos})
    lp, usage = resp.choices[0].logprobs, resp.usage
    values = lp.token_logprobs if lp else []
    if len(values) != usage.prompt_tokens + usage.completion_tokens or values[0] is not None \
            or any(v is None for v in values[1:]) or not all(lp.top_logprobs[1:]):
        raise BadAnswer(f"logprobs: {len(values)} entries for {usage.prompt_tokens} + {usage.completion_tokens} "
                        f"tokens, {sum(v is None for v in values)} without a logprob")
    rec.add_tokens(usage.completion_tokens)


# name -> one request of that kind: raises on a failure or a malformed answer, credits its tokens
KINDS: dict[str, Callable[[Any, str, str, argparse.Namespace, MinuteTally], None]] = {
    "plain": _plain, "json-schema": _json_schema, "tool-call": _tool_call, "n2": _n2, "logprobs": _logprobs,
    "copy": _copy}


def parse_mix(text: str) -> tuple[str, ...]:
    """--mix: "all" or kind names separated by commas (in order, each once)."""
    names = tuple(KINDS) if text.strip() == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in KINDS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--mix {text!r}: give 'all' or distinct names from {', '.join(KINDS)}")
    return names


def kind_for(index: int, n: int, mix: Sequence[str]) -> str:
    """Client `index`'s `n`-th request's kind: the clients start staggered, so every kind runs at once."""
    return mix[(index + n) % len(mix)]


def run_client(index: int, client: Any, model: str, args: argparse.Namespace, stop_at: float, rec: MinuteTally) -> None:
    """One request after another until `stop_at`, taking turns at the kinds of --mix."""
    n = 0
    while time.monotonic() < stop_at:
        kind = kind_for(index, n, args.mix)
        prompt = f"{PROMPTS[(index + n) % len(PROMPTS)]} (client {index}, request {n})"
        n += 1
        try:
            KINDS[kind](client, model, prompt, args, rec)
            rec.finish_request(kind)
        except Exception as exc:  # every failure is a data point; the client carries on
            rec.error(f"client {index} {kind}: {type(exc).__name__}: {exc}"[:300])


def read_pids(run_dir: Path | None) -> dict[str, int]:
    if run_dir is None:
        return {}
    return {f.stem: int(f.read_text().split()[0]) for f in sorted(run_dir.glob("*.pid")) if f.read_text().strip()}


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def stage_gauges(url: str, name: str) -> dict[str, float]:
    """One per-stage gauge from the driver's /metrics (skippy_stage_<name>{stage=...}); {} when unreadable."""
    import httpx

    try:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {sid: float(v) for sid, v in re.findall(rf'^skippy_stage_{name}\{{stage="(\w+)"\}} ([0-9.e+-]+)$', text, re.M)}


def wait_warmed(url: str, timeout: float) -> float:
    """Wait until no stage has idle warm-up compiles left (skippy_stage_warmups_pending), so the
    memory baseline is not taken in the middle of them; seconds waited."""
    t0 = time.monotonic()
    while any(stage_gauges(url, "warmups_pending").values()) and time.monotonic() - t0 < timeout:
        time.sleep(1.0)    # heartbeats refresh the gauge; nothing to block on
    return time.monotonic() - t0


def sample_memory(run_dir: Path | None, url: str, rec: MinuteTally, every_s: float, done: threading.Event) -> None:
    """RSS of every process in the run's pid files and each stage's prefix-store bytes (the driver's
    /metrics), now and every `every_s` seconds until `done`."""
    pids = read_pids(run_dir)
    while True:
        sample = {name: rss_mb(pid) for name, pid in pids.items()}
        for name, value in sample.items():
            if value is None:
                rec.error(f"process {name} (pid {pids[name]}) is gone")
        cache = {sid: round(v / 2**20, 1) for sid, v in stage_gauges(url, "cache_bytes").items()}
        rec.sample({name: round(v, 1) for name, v in sample.items() if v is not None}, cache)
        if done.wait(every_s):
            return


# ---------------------------------------------------------------- report


def minute_rows(rec: MinuteTally, duration_s: float) -> list[dict[str, Any]]:
    """One row per started minute; the last, partial minute's tok/s is over the seconds it had."""
    rows = []
    for m in range(max(1, int(-(-duration_s // 60)))):
        last = [s["rss_mb"] for s in rec.rss if m * 60 <= s["t"] < (m + 1) * 60]
        seconds = max(1e-9, min(60.0, duration_s - 60 * m))
        row = {"minute": m + 1, "requests": rec.requests.get(m, 0), "tokens": rec.tokens.get(m, 0),
               "tok_s": round(rec.tokens.get(m, 0) / seconds, 1), "errors": rec.errors.get(m, 0)}
        row.update({f"{name}_rss_mb": value for name, value in (last[-1] if last else {}).items()})
        caches = [s.get("cache_mb", {}) for s in rec.rss if m * 60 <= s["t"] < (m + 1) * 60]
        row.update({f"{name}_cache_mb": value for name, value in (caches[-1] if caches else {}).items()})
        rows.append(row)
    return rows


def mean_rss(rec: MinuteTally, t0: float, t1: float) -> dict[str, float]:
    values: dict[str, list[float]] = defaultdict(list)
    for s in rec.rss:
        if t0 <= s["t"] < t1:
            for name, v in s["rss_mb"].items():
                values[name].append(v)
    return {name: statistics.fmean(v) for name, v in values.items()}


STORE_FULL = 0.98   # a prefix store this close to the most it held in the run has stopped filling


def store_full_s(rec: MinuteTally) -> float:
    """When the last stage's prefix store stopped filling: the first sample at which every store held
    STORE_FULL of the most it held in the run (0 when no store held anything)."""
    peaks: dict[str, float] = defaultdict(float)
    for s in rec.rss:
        for sid, mb in s.get("cache_mb", {}).items():
            peaks[sid] = max(peaks[sid], mb)
    full = 0.0
    for sid, peak in peaks.items():
        if peak > 0:
            full = max(full, next(s["t"] for s in rec.rss if s.get("cache_mb", {}).get(sid, 0.0) >= STORE_FULL * peak))
    return full


def memory_verdict(rec: MinuteTally, duration_s: float, warmup_min: float, flat_pct: float) -> dict[str, Any]:
    """Mean RSS over the last minute against the mean over the first minute after warm-up.

    Warm-up ends after `warmup_min` minutes or when the prefix stores stop filling (they grow
    up to their budget by design), whichever is later. A run that leaves less than two minutes
    after it cannot be judged (`flat` None); its numbers compare the run's second half with its
    first instead.
    """
    end = max(60 * warmup_min, store_full_s(rec))
    judged = duration_s >= end + 120
    if judged:
        base, last = mean_rss(rec, end, end + 60), mean_rss(rec, duration_s - 60, 1e9)
    else:
        base, last = mean_rss(rec, 0, duration_s / 2), mean_rss(rec, duration_s / 2, 1e9)
    per_process = {name: {"baseline_mb": round(base[name], 1), "last_mb": round(last[name], 1),
                          "growth_pct": round(100 * (last[name] - base[name]) / base[name], 2)}
                   for name in sorted(base) if name in last and base[name] > 0}
    flat = all(abs(p["growth_pct"]) <= flat_pct for p in per_process.values()) if judged and per_process else None
    return {"judged": judged, "flat": flat, "flat_pct": flat_pct, "warmup_end_min": round(end / 60, 2),
            "processes": per_process}


def report(rec: MinuteTally, args: argparse.Namespace, url: str, duration_s: float, out: Path) -> dict[str, Any]:
    rows = minute_rows(rec, duration_s)
    total_tokens, total_errors = sum(rec.tokens.values()), sum(rec.errors.values())
    memory = memory_verdict(rec, duration_s, args.warmup_minutes, args.flat_pct)
    summary = {"url": url, "streams": args.streams, "duration_s": round(duration_s, 1),
               "requests": sum(rec.requests.values()), "requests_by_kind": dict(rec.by_kind), "tokens": total_tokens,
               "tok_s": round(total_tokens / duration_s, 1) if duration_s else 0.0, "errors": total_errors,
               "zero_errors": total_errors == 0, "memory": memory}
    summary["ok"] = summary["zero_errors"] and memory["flat"] is not False
    mem_rows = [{"process": name, **p} for name, p in memory["processes"].items()]
    verdict = (f"errors: {total_errors}; memory flat after warm-up (to minute {memory['warmup_end_min']}): "
               f"{'not judged (run too short)' if memory['flat'] is None else memory['flat']}; "
               f"{'OK' if summary['ok'] else 'FAILED'}")
    text = (format_table(f"Soak: {args.streams} streams for {duration_s / 60:.1f} min against {url}", rows,
                         f"{summary['requests']} requests ({', '.join(f'{k} {v}' for k, v in sorted(rec.by_kind.items()))}), "
                         f"{total_tokens} tokens, {summary['tok_s']} tok/s overall")
            + "\n" + format_table("Memory (MB)", mem_rows, verdict))
    print(text, flush=True)
    for line in rec.error_samples[:10]:
        print(f"  error: {line}")
    out.mkdir(parents=True, exist_ok=True)
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "summary": summary, "minutes": rows, "rss_samples": rec.rss, "error_samples": rec.error_samples}
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    (out / "soak.md").write_text(text)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.md'}")
    return result


# ---------------------------------------------------------------- processes


def stop_run(run_dir: Path, timeout: float = 10.0) -> None:
    """scripts/stop.sh semantics: SIGTERM every pid file's process, wait, SIGKILL leftovers, remove the files.
    Our own children are reaped as they exit, so a zombie never counts as still running."""
    pids = read_pids(run_dir)
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    alive = set(pids.values())
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _running(pid)}
        if alive:
            time.sleep(0.1)    # waiting for other processes to exit; nothing to block on
    for pid in alive:
        print(f"pid {pid} did not stop in {timeout:g} s; killing it")
        os.kill(pid, signal.SIGKILL)
        _running(pid)
    for f in run_dir.glob("*.pid"):
        f.unlink()


def _running(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:      # not our child: ask the kernel, zombies excluded
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    return True


def start(args: argparse.Namespace) -> tuple[str, Path | None, bool]:
    """(API base URL, run dir holding pid files or None, whether we launched it)."""
    if args.url:
        return args.url.rstrip("/"), args.run_dir, False
    from skippy_zmq.ops.launch import launch
    from skippy_zmq.config.topology_yaml import load_topology

    run_dir = args.run_dir or Path(f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"launching {args.topology} into {run_dir} ...", flush=True)
    url = launch(load_topology(args.topology), args.topology, run_dir, args.ready_timeout)
    return url, run_dir, True


def soak(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    url, run_dir, launched = start(args)
    out = args.out or run_dir or Path(f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        client = openai.OpenAI(base_url=url, api_key=args.api_key or os.environ.get("SKIPPY_API_KEY", "unused"),
                               max_retries=0, timeout=args.request_timeout)
        model = client.models.list().data[0].id
        print(f"stages' idle warm-up compiles done after {wait_warmed(url, args.ready_timeout):.0f} s", flush=True)
        print(f"soaking {url} (model {model}) with {args.streams} streams for {args.minutes:g} min", flush=True)
        rec = MinuteTally(start=time.monotonic())
        stop_at = rec.start + 60 * args.minutes
        done = threading.Event()
        sampler = threading.Thread(target=sample_memory, args=(run_dir, url, rec, args.sample_s, done), daemon=True)
        sampler.start()
        clients = [threading.Thread(target=run_client, args=(i, client, model, args, stop_at, rec), daemon=True)
                   for i in range(args.streams)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(max(0.0, stop_at - time.monotonic()) + args.request_timeout + 5)
        duration = time.monotonic() - rec.start
        done.set()
        sampler.join(5)
        for c in clients:
            if c.is_alive():
                rec.error("a client did not finish its last request within the request timeout")
        return report(rec, args, url, duration, out)
    finally:
        if launched and run_dir is not None:
            stop_run(run_dir)
            print(f"stopped the processes of {run_dir}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skippy_zmq.devtools.soak", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--topology", type=Path, help="launch this topology, soak it, stop it")
    where.add_argument("--url", help="soak an already running server (API base URL, e.g. http://127.0.0.1:8000/v1)")
    p.add_argument("--run-dir", type=Path, help="run directory (pid files, logs); default runs/soak-<time>")
    p.add_argument("--out", type=Path, help="where soak.json and soak.md go; default the run directory")
    p.add_argument("--streams", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--mix", type=parse_mix, default=("plain",),
                   help=f"kinds of request the clients take turns at: 'all' or names from {', '.join(KINDS)}")
    p.add_argument("--minutes", type=float, default=10.0, help="how long to keep starting requests")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate max_tokens every time, so every request costs the same")
    p.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period")
    p.add_argument("--warmup-minutes", type=float, default=2.0, help="shortest warm-up; it also lasts until the prefix stores stop filling")
    p.add_argument("--flat-pct", type=float, default=5.0, help="allowed RSS change after warm-up, percent")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client timeout per request, seconds")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="how long a launch may take to be ready")
    p.add_argument("--api-key", help="bearer token (default $SKIPPY_API_KEY)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.streams < 1 or args.minutes <= 0:
        raise SystemExit("--streams must be >= 1 and --minutes > 0")
    return 0 if soak(args)["summary"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
