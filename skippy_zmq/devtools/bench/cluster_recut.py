"""`bench cluster` re-cut row: a host slowed from 100% to 25% of a core while 8 greedy streams run.

Two hosts (devtools/hosts.py CPU groups at 100% of a core each, no namespaces: the workers and
their stages reach the driver on loopback), each a real `skippy-zmq worker` that joins the
driver's ClusterServer, measures itself (`split: measured`), fetches its items and runs its stage;
the driver here plans for 8-stream throughput and serves with the rebalancer attached
(engine/recut.py), as `skippy-zmq driver` does. In one run, on the same 8 streams:

1. `before`: both hosts at 100%, the planned split;
2. host b's `cpu.cfs_quota_us` goes to 25% of a core; with the drift trigger held off
   (recut_threshold 0, as `cluster.recut_threshold: 0` would run), the `without` window is the
   time per token without a re-cut;
3. the drift trigger is let go (recut_threshold 1.3 over RECUT_WINDOW_S; `--recut-trigger
   command` asks `rebalance` instead): the driver re-cuts, the streams pause, resume from their
   token history on the new split; once its stages warmed up, the `after` window.

Both windows run the same streams on the same machine minutes apart, so the ratio does not
depend on what the machine's other load was in another run. The streams are then stopped and
each one's tokens compared with the one-process engine's greedy tokens for the same prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

from skippy_zmq.devtools.bench.pipeline import TraceLog
from skippy_zmq.devtools.hosts import SHARES, Hosts, HostSpec, driver_group

HOSTS = (HostSpec("a", 1.0, shares=SHARES), HostSpec("b", 1.0, shares=SHARES))
SLOWED, SLOW_TO = 1, 0.25          # host b: 100% -> 25% of a core
STREAMS = 8
PROMPT_TOKENS = 32
CONTEXT = 2048                      # the streams run until stopped: room for ~2000 tokens each (a re-cut that
                                    # prepares its stages before the switch takes minutes on the slowed host)
MAX_TOKENS = CONTEXT - PROMPT_TOKENS - 8
WINDOW_S = 10.0                     # each measured window (before the slowdown: half of it)
SETTLE_S = 3.0                      # after the slowdown / the re-cut's warm-up, before a window opens
RECUT_THRESHOLD, RECUT_WINDOW_S = 1.3, 5.0
START_TIMEOUT_S, RECUT_TIMEOUT_S = 600.0, 420.0
GOAL = 1.3
GONE_AFTER_S = 15.0                 # the default cluster.gone_after_s
MAX_RECUTS = 3                      # re-cuts after the slowdown before the row takes its `after` window


class StreamSet:
    """STREAMS greedy streams on threads, each token timestamped; `stop()` cancels them."""

    def __init__(self, engine: Any, prompts: list[list[int]]):
        self.times: list[list[float]] = [[] for _ in prompts]
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[str] = []
        self.done = threading.Event()
        self.log = TraceLog()                       # each decode step's per-stage compute
        engine.on_reply_hooks.append(self.log)
        self.threads = [threading.Thread(target=self._run, args=(engine, i, p), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, engine: Any, i: int, prompt: list[int]) -> None:
        from skippy_zmq.engine.request import GenRequest

        events = engine.generate_blocking(GenRequest(f"recut{i}", tuple(prompt), max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))
        try:
            for event in events:
                if event.token_id is not None:
                    self.tokens[i].append(event.token_id)
                    self.times[i].append(time.perf_counter())
                if self.done.is_set():
                    break
        except Exception as exc:   # counted: the row's goal is none
            self.errors.append(f"stream {i}: {exc}")
        finally:
            events.close()   # a stream stopped early is cancelled

    def count(self) -> int:
        return min(len(t) for t in self.tokens)

    def wait_tokens(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.count() < n:
            if self.errors or time.monotonic() > deadline:
                raise RuntimeError(f"streams reached {self.count()} of {n} tokens; errors {self.errors[:2]}")
            time.sleep(0.2)   # polling a counter from a bench: nothing to block on

    def stop(self, timeout: float = 120.0) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        return {**window_rate(self.times, t0, t1), **stage_steps(self.log.window(t0, t1, steps_only=True))}


def timeline(times: list[list[float]], t0: float, bin_s: float = 2.0) -> list[int]:
    """Tokens of every stream in each bin_s-second bin from t0 (the slowdown): where the time went."""
    bins: list[int] = []
    for t in (t for ts in times for t in ts if t >= t0):
        i = int((t - t0) / bin_s)
        bins.extend([0] * (i + 1 - len(bins)))
        bins[i] += 1
    return bins


def stage_steps(traces: list[list[dict[str, Any]]]) -> dict[str, str]:
    """Each stage's decode-step compute in the window, median and worst (ms): where the time went."""
    per: dict[str, list[float]] = {}
    for trace in traces:
        for hop in trace:
            per.setdefault(str(hop.get("stage")), []).append(float(hop.get("compute_ms") or 0.0))
    return {"step_ms": " / ".join(f"{statistics.median(v):.1f}" for v in per.values()),
            "step_ms_max": " / ".join(f"{max(v):.0f}" for v in per.values())}


def window_rate(times: list[list[float]], t0: float, t1: float) -> dict[str, Any]:
    """Aggregate tokens per second and the median gap between a stream's tokens, in [t0, t1)."""
    n = sum(1 for ts in times for t in ts if t0 <= t < t1)
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if t0 <= a and b < t1]
    return {"tok_s": round(n / (t1 - t0), 2), "ms_per_token": round(1000 * statistics.median(gaps), 1)
            if gaps else None, "tokens": n, "seconds": round(t1 - t0, 1)}


def recut_goals(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's row: no failed request, every stream's tokens the one process's, and tok/s after
    the re-cut over tok/s without it (the same streams, host b slowed) at least GOAL."""
    without, after = row["without"]["tok_s"], row["after"]["tok_s"]
    ratio = round(after / without, 2) if without and after else None
    return [{"check": f"re-cut while {row['streams']} streams run (host b 100% -> {SLOW_TO:.0%}): failed requests",
             "goal": "0", "measured": row["failed"], "met": row["failed"] == 0},
            {"check": "greedy output identical to one process (streams)", "goal": f"{row['streams']}/{row['streams']}",
             "measured": f"{row['identical']}/{row['streams']}", "met": row["identical"] == row["streams"]},
            {"check": "tok/s after the re-cut / without it (time per token, x better)", "goal": f">= {GOAL}",
             "measured": ratio, "met": ratio is not None and ratio >= GOAL}] + ([
            {"check": f"worker b then gone for good, the same {row['streams']} streams: failed; identical",
             "goal": f"0; {row['streams']}/{row['streams']}", "measured": f"{row['failed']}; {row['identical']}/"
             f"{row['streams']}", "met": row["failed"] == 0 and row["identical"] == row["streams"]}]
            if row.get("gone_reason") else [])


def recut_topology(tmp: Path, model: Path, weights: str) -> Path:
    from skippy_zmq.config.topology_yaml import plan_topology
    from skippy_zmq.devtools.harness import free_base_port

    base = free_base_port(5)
    keys = [{"weights": weights, "kv_lanes": STREAMS, "cache": {"mode": "disabled"}} for _ in HOSTS]
    data = plan_topology(_layers(model), len(HOSTS), model=str(model), base_port=base, stage_keys=keys,
                         driver_keys={"max_context": CONTEXT, "max_sessions": STREAMS, "dead_after_s": 30.0,
                                      "request_timeout_s": 1800.0, "resume_timeout_s": 900.0}).to_dict()
    data["driver"]["http"] = f"127.0.0.1:{base + 3}"
    # threshold 0 (drift off) until the bench lets it go: see the module's docstring
    data["cluster"] = {"listen": f"tcp://127.0.0.1:{base + 4}", "split": "measured", "objective": "throughput",
                       "streams": STREAMS, "recut": True, "recut_threshold": 0, "recut_window_s": RECUT_WINDOW_S,
                       "gone_after_s": GONE_AFTER_S}
    path = tmp / "recut.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _layers(model: Path) -> int:
    from skippy_zmq.config.model import ModelConfig

    return ModelConfig.load(model / "model.json").n_layers


@contextmanager
def cluster_serving(hosts: Hosts, path: Path, tmp: Path) -> Iterator[tuple[Any, Any, Any, Any, list[Any]]]:
    """Workers in their hosts joined and serving, the engine ready with the rebalancer attached:
    (server, engine, tokenizer, rebalancer, the worker processes in host order)."""
    from skippy_zmq.api.main import open_engine
    from skippy_zmq.cluster.server import ClusterServer
    from skippy_zmq.config.topology_yaml import load_topology
    from skippy_zmq.devtools.harness import wait_warmed
    from skippy_zmq.engine.recut import attach_rebalancer
    from skippy_zmq.ops.launch import stop_processes
    from skippy_zmq.ops.lifetime import tied_env

    server = ClusterServer(load_topology(path))
    procs, engine, rebalancer = [], None, None
    try:
        for i, spec in enumerate(hosts.specs):
            argv = [sys.executable, "-m", "skippy_zmq.cli", "worker", "--join", server.token.text(), "--cache",
                    str(Path.home() / ".cache" / "skippy_zmq" / "bench-recut" / spec.name), "--name", spec.name,
                    "--no-devices", "--join-timeout", "120"]
            with open(tmp / f"worker-{spec.name}.log", "ab") as log:
                procs.append(subprocess.Popen(hosts.wrap(i, argv), stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=tied_env(True)))
        started = lambda: sum(1 for w in server.workers.values() if w.started) == len(hosts.specs)  # noqa: E731
        if not server.wait_until(lambda: started() or any(p.poll() is not None for p in procs), START_TIMEOUT_S) \
                or not started():
            raise RuntimeError(f"workers did not start their stages; logs in {tmp}")
        engine, tokenizer = open_engine(server.placed)
        if not engine.wait_ready(START_TIMEOUT_S):
            raise RuntimeError(f"the split was not ready: {engine.not_ready_reason()}")
        wait_warmed(engine, START_TIMEOUT_S)
        rebalancer = attach_rebalancer(server, engine)
        yield server, engine, tokenizer, rebalancer, procs
    finally:
        for closer in (rebalancer, engine):
            if closer is not None:
                closer.close()
        stop_processes(procs)
        server.close()


def split_text(server: Any) -> str:
    by_stage = {w.stage: w.name for w in server.workers.values() if w.stage is not None}
    return " / ".join(f"{by_stage.get(s.id, '?')}:{s.end - s.start}" for s in server.topology.stages)


def set_quota(hosts: Hosts, i: int, cores: float) -> None:
    hosts.groups[i].set_cores(cores)


def trigger_recut(rebalancer: Any, mode: str) -> float:
    """Let the drift trigger go (or ask `rebalance`); the perf_counter time it was let go."""
    drift = rebalancer.drift
    drift.window_s = RECUT_WINDOW_S if mode == "drift" else 1e9   # command: observe, never trigger
    drift.threshold = RECUT_THRESHOLD
    t = time.perf_counter()
    if mode == "command":
        deadline = time.monotonic() + 120
        while min([drift.samples.get(s, 0) for s in drift.plan] or [0]) < 30 and time.monotonic() < deadline:
            time.sleep(0.2)   # enough replies for the fresh numbers (drift.MIN_SAMPLES)
        rebalancer.request("asked for (bench cluster --recut-trigger command)")
    return t


def wait_recut(rebalancer: Any, engine: Any, streams: StreamSet, done_before: int) -> dict[str, Any]:
    """Until a re-cut is done, its stages are ready, done compiling behind serving (the drift
    monitor's gate too; their idle warm-ups wait for idle time 8 streams do not leave) and the
    streams move again."""
    deadline = time.monotonic() + RECUT_TIMEOUT_S
    while len(rebalancer.history) == done_before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no re-cut within {RECUT_TIMEOUT_S:g} s (drift ratios {rebalancer.drift.ratio})")
        time.sleep(0.2)
    t_switched = time.perf_counter()
    if not engine.wait_ready(RECUT_TIMEOUT_S):
        raise RuntimeError(f"the new split was not ready: {engine.not_ready_reason()}")
    t_ready = time.perf_counter()
    while any(state.info.get("compiling", True) for state in engine.stages.values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the new split's stages still compiling after {RECUT_TIMEOUT_S:g} s")
        time.sleep(0.2)   # heartbeats carry it; nothing to block on
    t_warmed = time.perf_counter()
    n = streams.count()
    streams.wait_tokens(n + 2, RECUT_TIMEOUT_S)   # every stream re-prefilled and decoding again
    return {"switched": t_switched, "ready": t_ready, "warmed": t_warmed, "moving": time.perf_counter(),
            **rebalancer.history[-1]}


def after_window(rebalancer: Any, engine: Any, streams: StreamSet, recuts: list[dict[str, Any]]) -> dict[str, Any]:
    """The window after the last re-cut: when the drift finds more to move meanwhile (a first
    re-cut planned with a ratio taken at the old split), after that one instead (MAX_RECUTS)."""
    while True:
        done = len(rebalancer.history)
        time.sleep(SETTLE_S + WINDOW_S)
        t0 = recuts[-1]["moving"] + SETTLE_S
        if len(rebalancer.history) == done or len(recuts) >= MAX_RECUTS:
            return streams.window(t0, t0 + WINDOW_S)
        recuts.append(wait_recut(rebalancer, engine, streams, done))


def gone_phase(rebalancer: Any, engine: Any, streams: StreamSet, proc: Any) -> dict[str, Any]:
    """Worker b killed for good (SIGKILL: its stage dies with it) while the streams run; the
    driver plans around it once it is silent for GONE_AFTER_S (worker a has the memory for every
    layer), and the streams go on from their token history."""
    done = len(rebalancer.history)
    proc.kill()
    t_kill = time.perf_counter()
    recut = wait_recut(rebalancer, engine, streams, done)
    return {"gone_reason": recut["reason"], "gone_to_serving_s": round(recut["moving"] - t_kill, 1)}


def run_recut(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], list[list[int]], list[list[int]]]:
    """The three windows on one cluster; (row, prompts, each stream's tokens)."""
    from skippy_zmq.devtools.bench.common import synthetic_prompt
    from skippy_zmq.devtools.bench.pipeline import stream_prompts

    model, weights = Path(args.model).absolute(), args.weights or "q4"
    mode = args.recut_trigger
    t_start = time.perf_counter()
    with Hosts(HOSTS, netns=False) as hosts, driver_group(hosts.tag), \
            cluster_serving(hosts, recut_topology(tmp, model, weights), tmp) as (server, engine, tok, rebalancer, procs):
        start_s, planned = time.perf_counter() - t_start, split_text(server)
        print(f"[bench cluster recut] serving {planned} after {start_s:.0f} s", flush=True)
        prompts = stream_prompts(synthetic_prompt(tok, PROMPT_TOKENS), STREAMS, salt=7)
        streams = StreamSet(engine, prompts)
        try:
            streams.wait_tokens(4, START_TIMEOUT_S)
            t0 = time.perf_counter()
            time.sleep(WINDOW_S / 2)   # the reference's one lane must generate every token again: keep it short
            before = streams.window(t0, t0 + WINDOW_S / 2)
            set_quota(hosts, SLOWED, SLOW_TO)
            t_slow = time.perf_counter()
            time.sleep(SETTLE_S + WINDOW_S)
            without = streams.window(t_slow + SETTLE_S, t_slow + SETTLE_S + WINDOW_S)
            print(f"[bench cluster recut] before {before}, slowed without a re-cut {without}", flush=True)
            done_before = len(rebalancer.history)
            t_let = trigger_recut(rebalancer, mode)
            recuts = [wait_recut(rebalancer, engine, streams, done_before)]
            after = after_window(rebalancer, engine, streams, recuts)
            print(f"[bench cluster recut] after the re-cut {after}", flush=True)
            split_after, n_recuts = split_text(server), len(rebalancer.history)
            gone = gone_phase(rebalancer, engine, streams, procs[SLOWED])
            gone["split_gone"] = split_text(server)
            print(f"[bench cluster recut] worker b gone for good: {gone}", flush=True)
        finally:
            streams.stop()
        row = {"trigger": mode, "split_before": planned, "split_after": split_after, "recuts": n_recuts, **gone,
               "scale": {k: round(v, 2) for k, v in rebalancer.drift.scale.items()},
               "before": before, "without": without, "after": after,
               "detect_s": round(recuts[0]["switched"] - t_let, 1),
               "pause_s": [round(r["ready"] - r["switched"], 1) for r in recuts],
               "warm_s": [round(r["warmed"] - r["ready"], 1) for r in recuts],
               "moving_s": [round(r["moving"] - r["ready"], 1) for r in recuts], "start_s": round(start_s, 1),
               "reasons": [r["reason"] for r in recuts],
               "streams": STREAMS, "tokens_per_stream": [len(t) for t in streams.tokens],
               "timeline_2s": timeline(streams.times, t_slow),
               "marks_s": {"recut_let_go": round(t_let - t_slow, 1), **{f"recut{i}_{k}": round(r[k] - t_slow, 1)
                           for i, r in enumerate(recuts) for k in ("switched", "ready", "warmed", "moving")}},
               "failed": len(streams.errors),
               "errors": streams.errors[:4]}
    return row, prompts, streams.tokens


def reference_tokens(model: Path, weights: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The one-process engine's greedy tokens (the same weights format as the stages), the prompts
    as rows of one step (a lane each: the time of about one stream, where one at a time took ~6
    minutes for 8 x 450 tokens on the shared 2-core machine)."""
    from skippy_zmq.engine.generate import LocalEngine

    local = LocalEngine(model, capacity=CONTEXT, weights=weights, lanes=len(prompts))
    return local.generate_many(prompts, n, ignore_eos=True)


def bench_recut(args: argparse.Namespace, tables: list[str]) -> dict[str, Any]:
    """The row, checked against the one-process engine, with its goals; its JSON."""
    from skippy_zmq.devtools.bench.common import print_table

    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="skippy-recut-"))
    row, prompts, tokens = run_recut(args, tmp)
    row["load_avg"], row["load_avg_end"] = [round(v, 2) for v in load], [round(v, 2) for v in os.getloadavg()]
    want = reference_tokens(Path(args.model).absolute(), args.weights or "q4", prompts, max(map(len, tokens)))
    row["identical"] = sum(t == w[:len(t)] for t, w in zip(tokens, want))
    goals = recut_goals(row)
    row["after_over_without"] = goals[2]["measured"]   # the speed row (a gone row may follow)
    windows = [{"window": k, "split": row["split_after" if k == "after" else "split_before"], **row[k]}
               for k in ("before", "without", "after")]
    tables.append(print_table(
        f"cluster: re-cut while {STREAMS} streams run, host b slowed to {SLOW_TO:.0%} of a core "
        f"(trigger: {row['trigger']}; load average {load[0]:.1f} at the start, "
        f"{row['load_avg_end'][0]:.1f} at the end)",
        windows, f"{WINDOW_S:g} s windows of the same streams: tok_s aggregate, ms_per_token each stream's median gap; "
        f"{row['recuts']} re-cut(s), the first {row['detect_s']} s after the trigger was let go; "
        f"paused {row['pause_s']} s, "
        f"their stages done compiling {row['warm_s']} s and every stream decoding again {row['moving_s']} s after "
        f"READY. Then worker b killed: "
        f"{row.get('split_gone')} serving {row.get('gone_to_serving_s')} s after the kill."))
    tables.append(print_table("cluster: re-cut goals (issue 40)", goals))
    return {**row, "windows": windows, "goals": goals}
