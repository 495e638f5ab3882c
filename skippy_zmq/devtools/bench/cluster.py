"""`bench cluster`: three unequal hosts on this machine, the split by measured speed against the
even split, the memory-only split and the best split found by trying cuts.

Hosts (devtools/hosts.py): stage processes in cgroup v1 `cpu` groups at 100%, 50% and 25% of a
core over a 10 ms period, each in a network namespace of its own when the machine allows it (the
driver in this process, on the bridge). Each host is measured inside its group by `skippy-zmq
plan --measure` (cluster/measure.py) and its link to the driver by an echo server in its group and
namespace (cluster/probe.py), the planner (ops/speed.py) splits the model over one to three of them by those
numbers (hops costing round trip / 2 + activation bytes / bandwidth), and every split is then run for real: 1 stream (ms per token, inter-token
median) and 8 streams (steady aggregate tok/s), predicted beside measured.

Splits: planned for latency (1 stream) and for throughput (8 streams), each over one to three
hosts (plan_split's 1 to len(hosts) stages, as a user's planner would), even, memory-only (each
host the same budget: placement.fit_layers), and a grid of cut points (`--grid` layers apart) in
the best predicted host order of every host count from two up (`grid_orders`), run best predicted
first until the time budget is spent: the best measured of all is the "best by brute force" row.
The planner's choice among every cut and order is checked against brute force over the
predictions too. Held to all three hosts, the 1-stream plan of the 23:43 rerun was predicted 21.1
ms (measured 21.93) where h100 alone was predicted 18.64 (measured 19.86), and the 08:45 run's
8-stream plan h50:10 / h25:5 / h100:15 measured 121.9 tok/s where h100 alone measured 179.6.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from skippy_zmq.config.topology_yaml import load_topology, plan_topology
from skippy_zmq.devtools.bench.cluster_ring import machine_ms, measure_ring, with_ring
from skippy_zmq.devtools.bench.common import print_table, synthetic_prompt, write_report
from skippy_zmq.devtools.bench.pipeline import TraceLog, hop_medians, measure, stream_prompts
from skippy_zmq.devtools.hosts import SHARES, Hosts, HostSpec, cpu_cgroup_problem, driver_group, netns_problem
from skippy_zmq.ops import placement
from skippy_zmq.ops.launch import check_alive, prepare_keys, stage_command, stop_processes
from skippy_zmq.ops.lifetime import tied_env
from skippy_zmq.devtools.split_search import brute_force
from skippy_zmq.ops.speed import HostSpeed, Links, Stage, plan_split, predict

HOSTS = (HostSpec("h100", 1.0, shares=SHARES), HostSpec("h50", 0.5, shares=SHARES),
         HostSpec("h25", 0.25, shares=SHARES))
STREAMS = 8
NEW_TOKENS = 24
PROMPT_TOKENS = 32
CONTEXT = 256          # few attention buckets: few shapes for a stage to compile at 25% of a core
LANES = 8
PORT = 5611            # + stage index: stage listen port inside each namespace (each has its own port space)
PROBE_PORT = 5620      # + host index: cluster/probe.py's echo server in each host, for its link


def probe_links(hosts: Hosts) -> tuple[Any, list[dict[str, Any]]]:
    """Each host's link to the driver measured (cluster/probe.py: round trip, bandwidth), an echo
    server in the host's group and namespace, so the round trip includes a throttled host waking
    up; a link between two hosts is taken as the mean of theirs (both sit on one bridge)."""
    from skippy_zmq.cluster.probe import echo_client, measure_link

    rows = []
    for i, spec in enumerate(hosts.specs):
        endpoint = f"tcp://{hosts.address(i)}:{PROBE_PORT + i}"
        argv = hosts.wrap(i, [sys.executable, "-m", "skippy_zmq.cluster.probe", endpoint])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=tied_env(True))
        try:
            proc.stdout.readline()    # "ready": bound
            ask, close = echo_client(endpoint)
            try:
                rows.append({"host": spec.name, **measure_link(ask)})
            finally:
                close()
        finally:
            proc.kill()
            proc.wait()
    print(f"[bench cluster] links to the driver: {rows}", flush=True)
    return driver_links(rows), rows


def driver_links(rows: list[dict[str, Any]]) -> Links:
    """Links from each host's measured link to the driver ({host, rtt_ms, bytes_per_s}); a link
    between two hosts the mean of theirs."""
    from skippy_zmq.ops.speed import DRIVER

    rtt = {(DRIVER, r["host"]): r["rtt_ms"] for r in rows}
    rate = {(DRIVER, r["host"]): r["bytes_per_s"] for r in rows}
    return Links.from_rtt(statistics.mean(rtt.values()), rtt, statistics.mean(rate.values()), rate)


def even_ranges(n_layers: int, n: int) -> list[tuple[int, int]]:
    cuts = [round(i * n_layers / n) for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


def grid_splits(order: Sequence[str], n_layers: int, step: int) -> list[tuple[Stage, ...]]:
    """Every split of the hosts in `order` with cuts on multiples of `step`."""
    points = range(step, n_layers, step)
    return [tuple(Stage(h, a, b) for h, a, b in zip(order, (0, *cuts), (*cuts, n_layers)))
            for cuts in itertools.combinations(points, len(order) - 1)]


def measure_hosts(hosts: Hosts, model: Path, weights: str, tmp: Path) -> list[dict[str, Any]]:
    """`skippy-zmq plan --measure` inside each host (its group and namespace): one after another
    (1 stream: one stage computes at a time), then all at once; the many-row figures the planner
    takes lie between the two (`many_rows`). The lone figures stay as decode_alone, the others'
    as decode_together."""
    alone = [_measure(hosts, [i], model, weights, tmp, "alone")[0] for i in range(len(hosts.specs))]
    together = _measure(hosts, list(range(len(hosts.specs))), model, weights, tmp, "together")
    for m, t in zip(alone, together):
        many_rows(m, t)
        print(f"[bench cluster] {m['name']}: layer ms at 4 / 8 rows alone "
              f"{m['decode_alone']['4']['layer_ms']} / {m['decode_alone']['8']['layer_ms']}, with every host busy "
              f"{t['decode']['4']['layer_ms']} / {t['decode']['8']['layer_ms']}", flush=True)
    return alone


TOGETHER = 0.5   # the weight of the all-busy figures in a host's many-row step (many_rows)


def many_rows(alone: dict[str, Any], together: dict[str, Any]) -> dict[str, Any]:
    """`alone`'s many-row decode figures (4, 8 rows) made the mean of its lone and all-busy ones, in
    place: N streams keep the hosts busy together only part of a round (the quiet run's bubbles
    were 0.04-0.94), and hosts on one machine share its cores, so a step is slower than alone and
    faster than with every host measuring at once (all-busy figures alone predicted a bottleneck
    host 1.3x slow where the others idled 90% of the round; lone ones 1.14x fast where every host
    was busy). On separate machines the two agree and so does their mean."""
    alone["decode_alone"] = {r: dict(v) for r, v in alone["decode"].items()}
    alone["decode_together"] = {r: dict(v) for r, v in together["decode"].items()}
    for r, v in together["decode"].items():
        if r != "1" and r in alone["decode"]:
            lone = alone["decode"][r]
            alone["decode"][r] = {k: _blend(lone.get(k, x), x) for k, x in v.items()}
    return alone


def _blend(lone: Any, busy: Any) -> Any:
    """many_rows' mean of a lone and an all-busy figure (the CPU figures' dict key by key)."""
    if isinstance(busy, dict):
        return {k: _blend(lone.get(k, x), x) for k, x in busy.items()}
    return round((1 - TOGETHER) * lone + TOGETHER * busy, 4)


def _measure(hosts: Hosts, which: list[int], model: Path, weights: str, tmp: Path, tag: str) -> list[dict[str, Any]]:
    procs, paths, t0 = [], [], time.perf_counter()
    for i in which:
        spec = hosts.specs[i]
        path = tmp / f"measure-{spec.name}-{tag}.json"
        argv = [sys.executable, "-m", "skippy_zmq.cli", "--log-level", "WARNING", "plan", "--measure", "--model",
                str(model), "--weights", weights, "--name", spec.name, "--measure-out", str(path),
                "--measure-position", str(PROMPT_TOKENS + NEW_TOKENS // 2)]   # the rows' middle position
        # the plan after the measurement may find no room in this machine's free memory: not our question.
        # In the host's CPU group but not its namespace (measuring needs no network, and `ip netns exec`
        # hides the cgroup folders the measurement reads its quota from)
        group = hosts.groups[i]
        procs.append(subprocess.Popen(group.wrap(argv) if group is not None else argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=tied_env(True)))
        paths.append(path)
    for proc in procs:
        proc.wait(timeout=600)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise RuntimeError(f"measuring wrote no {', '.join(missing)}")
    out = [json.loads(p.read_text()) for p in paths]
    for i, m in zip(which, out):
        if hosts.specs[i].cpu is not None and "cpu_period_ms" not in m:
            print(f"[bench cluster] {m['name']}: its measurement read no CPU quota; idle starts not measured",
                  flush=True)
    for m in out:
        print(f"[bench cluster] measured {m['name']} ({tag}) in {time.perf_counter() - t0:.0f} s: layer "
              f"{m['decode']['1']['layer_ms']} ms, step {m['decode']['1']['step_ms']} ms, head "
              f"{m['decode']['1']['head_ms']} ms at 1 row", flush=True)
    return out


def write_split_topology(tmp: Path, model: Path, hosts: Hosts, stages: Sequence[Stage], weights: str,
                         name: str) -> Path:
    from skippy_zmq.devtools.harness import free_base_port

    index = {spec.name: i for i, spec in enumerate(hosts.specs)}
    base = free_base_port(len(stages) + 2)
    cfg_layers = stages[-1].end
    keys = [{"weights": weights, "kv_lanes": LANES, "cache": {"mode": "disabled"}} for _ in stages]
    data = plan_topology(cfg_layers, len(stages), model=str(model), base_port=base, stage_keys=keys,
                         ranges=[(s.start, s.end) for s in stages],
                         driver_keys={"max_context": CONTEXT, "max_sessions": LANES, "dead_after_s": 30.0,
                                      "request_timeout_s": 600.0}).to_dict()
    data["driver"]["http"] = f"127.0.0.1:{base + len(stages) + 1}"
    if hosts.netns:
        data["driver"]["return"] = f"tcp://{hosts.driver_address}:{base}"
    for k, (stage, st) in enumerate(zip(data["stages"], stages)):
        if hosts.netns:   # `host` stays local: this process spawns it (stage_command would ssh otherwise)
            stage["listen"] = f"tcp://{hosts.address(index[st.host])}:{PORT + k}"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextmanager
def split_running(path: Path, hosts: Hosts, stages: Sequence[Stage], run_dir: Path, timeout: float = 300.0
                  ) -> Iterator[tuple[Any, Any]]:
    """The split's stages, each in its host (last first), and a driver engine here; (engine, tokenizer)."""
    from skippy_zmq.api.main import open_engine
    from skippy_zmq.devtools.harness import wait_warmed

    topology = load_topology(path)
    prepare_keys(path)
    run_dir.mkdir(parents=True, exist_ok=True)
    index = {spec.name: i for i, spec in enumerate(hosts.specs)}
    procs = []
    for stage_cfg, st in reversed(list(zip(topology.stages, stages))):
        with open(run_dir / f"{stage_cfg.id}.log", "ab") as log:
            argv = hosts.wrap(index[st.host], stage_command(path, stage_cfg, ["--log-level", "WARNING"]))
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=tied_env(True)))
    engine = None
    try:
        engine, tokenizer = open_engine(topology)
        deadline = time.monotonic() + timeout
        while not engine.wait_ready(0.5):
            check_alive(procs, run_dir)
            if time.monotonic() > deadline:
                raise TimeoutError(f"split not ready: {engine.not_ready_reason()}")
        wait_warmed(engine, timeout, procs, run_dir)
        yield engine, tokenizer
    finally:
        if engine is not None:
            engine.close()
        stop_processes(procs)


def stage_step_ms(traces: list[list[dict[str, Any]]], ids: Sequence[str]) -> list[float]:
    """Median compute_ms of each stage over decode-step traces (one trace per reply)."""
    per = {sid: [float(h["compute_ms"]) for t in traces for h in t if h.get("stage") == sid] for sid in ids}
    return [statistics.median(v) if v else 0.0 for v in per.values()]


def software_ms(traces: list[list[dict[str, Any]]], ids: Sequence[str], ms_per_token: float) -> dict[str, Any]:
    """Where a 1-stream token's time goes besides the stages' compute, from their telemetry (medians
    over decode steps): each stage's receive-to-send less its compute (its software per step), the
    transit between stages (send to the next one's receive: encode, wire, wake-up), and the rest of
    the token (the driver's loop, its two hops): ms_per_token less all of that and the compute."""
    hops = hop_medians(traces, ids)
    if hops is None:
        return {}
    own, transit, inside = hops["own"], hops["transit"], hops["inside"]
    return {"stage_sw_ms_1": " / ".join(f"{v:.2f}" for v in own),
            "transit_ms_1": " / ".join(f"{v:.2f}" for v in transit),
            "driver_ms_1": round(ms_per_token - inside - sum(transit), 2)}


def run_split(name: str, stages: Sequence[Stage], hosts: Hosts, model: Path, weights: str, tmp: Path,
              predicted: Any, many_streams: bool = True) -> dict[str, Any]:
    t0 = time.perf_counter()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")    # grid names hold slashes
    path = write_split_topology(tmp, model, hosts, stages, weights, slug)
    with split_running(path, hosts, stages, tmp / f"run-{slug}") as (engine, tokenizer):
        started = time.perf_counter() - t0
        log, ids = TraceLog(), tuple(f"s{i}" for i in range(len(stages)))
        engine.on_reply_hooks.append(log)
        base = synthetic_prompt(tokenizer, PROMPT_TOKENS)
        measure(engine, stream_prompts(base, STREAMS, salt=100), 4, strict=False)   # ramps the row buckets
        t0_one, busy0 = time.perf_counter(), engine.loop_busy_s
        one = measure(engine, [base], NEW_TOKENS, log, ids)
        loop_ms = 1000 * (engine.loop_busy_s - busy0) / NEW_TOKENS   # the driver loop's own time a token
        t0_many = time.perf_counter()
        steps_1 = log.window(t0_one, t0_many, steps_only=True)
        many = measure(engine, stream_prompts(base, STREAMS, salt=1), NEW_TOKENS, log, ids) if many_streams else {}
        steps = log.window(t0_many, time.perf_counter(), steps_only=True)
    row = {"split": name, "layers": _label(stages),
           "ms_per_token_1": one["itl_p50_ms"], "predicted_ms_1": round(predicted.ms_per_token_1, 2),
           # the stages' own compute per step (their telemetry) beside the model's Σ stage times
           "compute_ms_1": one.get("step_compute_ms"), "predicted_compute_ms_1": round(sum(predicted.stage_ms_1), 2),
           # each stage's own step compute at 1 stream beside the model's (burst) stage times
           "step_ms_1": " / ".join(f"{v:.1f}" for v in stage_step_ms(steps_1, ids)),
           "predicted_step_ms_1": " / ".join(f"{v:.1f}" for v in predicted.stage_ms_1),
           **software_ms(steps_1, ids, one["itl_p50_ms"]), "driver_loop_ms_1": round(loop_ms, 2),
           "tok_s_8": many.get("agg_tok_s"), "predicted_tok_s_8": round(predicted.tok_s_n, 1),
           "bubble_8": " / ".join(f"{v:.2f}" for v in many.get("bubble", {}).values()),
           # each stage's own step compute at 8 streams (median over its decode steps) beside the model's
           "step_ms_8": " / ".join(f"{v:.1f}" for v in stage_step_ms(steps, ids)),
           "predicted_step_ms_8": " / ".join(f"{v:.1f}" for v in predicted.stage_ms_n)}
    row["pred_over_meas_1"] = round(row["predicted_ms_1"] / row["ms_per_token_1"], 3)
    row["pred_over_meas_8"] = round(row["predicted_tok_s_8"] / row["tok_s_8"], 3) if row["tok_s_8"] else None
    row["start_s"], row["total_s"] = round(started, 1), round(time.perf_counter() - t0, 1)
    print(f"[bench cluster] {name}: {row}", flush=True)
    return row


PLAN_STAGES: dict[str, int | None] = {"latency": None, "throughput": None}   # None: 1 to len(hosts) stages


def plan_splits(speeds: list[HostSpeed], n_layers: int, need: Any, links: Links,
                row_bytes: int = 0) -> dict[str, tuple[Stage, ...]]:
    """The splits every run measures, but memory-only and the grid: planned for latency and for
    throughput over any number of the hosts (PLAN_STAGES), even over all of them."""
    names = [h.name for h in speeds]
    latency = plan_split(speeds, n_layers, need, links, "latency", STREAMS, PLAN_STAGES["latency"], row_bytes)
    throughput = plan_split(speeds, n_layers, need, links, "throughput", STREAMS, PLAN_STAGES["throughput"],
                            row_bytes)
    return {"planned (latency)": latency.stages, "planned (throughput)": throughput.stages,
            "even": tuple(Stage(h, a, b) for h, (a, b) in zip(names, even_ranges(n_layers, len(names))))}


def grid_orders(speeds: list[HostSpeed], n_layers: int, need: Any, links: Links,
                row_bytes: int = 0) -> list[tuple[str, ...]]:
    """The host orders the grid tries: the best predicted order of every host count from two up,
    for each objective (plan_split held to that count): when both plans are one host (h100 alone,
    as on the recorded runs' hosts) their orders leave the grid no split to try."""
    from skippy_zmq.ops.speed import OBJECTIVES, SpeedPlanError

    orders: list[tuple[str, ...]] = []
    for m in range(len(speeds), 1, -1):
        for objective in OBJECTIVES:
            try:
                plan = plan_split(speeds, n_layers, need, links, objective, STREAMS, m, row_bytes)
            except SpeedPlanError:     # no split of m of these hosts fits their memory
                continue
            order = tuple(s.host for s in plan.stages)
            if order not in orders:
                orders.append(order)
    return orders


def goal_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["split"]: r for r in rows}
    tok1 = {r["split"]: 1000 / r["ms_per_token_1"] for r in rows}
    best1, best8 = max(tok1.values()), max((r["tok_s_8"] or 0.0) for r in rows)
    lat, thr, even = by["planned (latency)"], by["planned (throughput)"], by["even"]
    ratios = [r[k] for r in rows for k in ("pred_over_meas_1", "pred_over_meas_8") if r.get(k)]
    return [
        {"check": "1 stream: planned / even split (tok/s)", "goal": ">= 2.0",
         "measured": round(tok1[lat["split"]] / tok1[even["split"]], 2)},
        {"check": "1 stream: planned / best measured split", "goal": ">= 0.95",
         "measured": round(tok1[lat["split"]] / best1, 3)},
        {"check": f"{STREAMS} streams: planned / best measured split", "goal": ">= 0.95",
         "measured": round(thr["tok_s_8"] / best8, 3) if best8 else None},
        {"check": "predicted / measured, every row", "goal": "0.85-1.15",
         "measured": f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else None},
    ]


PARTS = ("splits", "recut")   # `bench cluster --only recut`: the re-cut row alone (bench/cluster_recut.py)


def bench_cluster(args: argparse.Namespace, tables: list[str], _prior: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    problem = cpu_cgroup_problem()
    if problem:
        print(f"[bench cluster] skipped: cannot make CPU-quota hosts here: {problem}", flush=True)
        return {"skipped": problem}
    parts = [p for p in (args.only or ",".join(PARTS)).split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"bench cluster --only: unknown part(s) {', '.join(unknown)}; use {', '.join(PARTS)}")
    result = bench_splits(args, tables) if "splits" in parts else {}
    if "recut" in parts:
        from skippy_zmq.devtools.bench.cluster_recut import bench_recut

        result["recut"] = bench_recut(args, tables)
    write_report(args.out, "cluster", "bench cluster", result, [t for t in tables if t])
    return result


def bench_splits(args: argparse.Namespace, tables: list[str]) -> dict[str, Any]:
    from skippy_zmq.config.model import ModelConfig

    t_start = time.perf_counter()
    netns_why = netns_problem()
    model, weights = Path(args.model).absolute(), args.weights or "q4"
    cfg = ModelConfig.load(model / "model.json")
    settings = placement.StageSettings(weights, "float32", "f32", CONTEXT, LANES, 0, _stored(model))
    need = lambda a, b: placement.stage_need(cfg, a, b, settings).total   # noqa: E731
    budget = 4 * placement.GiB
    row_bytes = cfg.d_model * 4      # a decode activation row on the wire (f32)
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="skippy-cluster-"))
    with Hosts(HOSTS, netns=netns_why is None) as hosts, driver_group(hosts.tag):
        links, link_rows = probe_links(hosts)
        measured = measure_hosts(hosts, model, weights, tmp)
        machine = machine_ms()     # the machine's speed when measured; each row's beside it (machine_speed)
        for m, r in zip(measured, link_rows):
            m["link"] = r
        # what a token pays outside the stages, on a one-stage ring on the fastest host
        ring = measure_ring(lambda stages, name: split_running(
            write_split_topology(tmp, model, hosts, stages, weights, name), hosts, stages, tmp / f"run-{name}"),
            HOSTS[0].name, cfg.n_layers, link_rows[0]["rtt_ms"], PROMPT_TOKENS, NEW_TOKENS)
        links = with_ring(links, ring)
        speeds = [HostSpeed.from_measure(m, budget) for m in measured]
        by_name = {h.name: h for h in speeds}
        splits = plan_splits(speeds, cfg.n_layers, need, links, row_bytes)
        fit = placement.fit_layers(cfg, [budget] * len(speeds), [settings] * len(speeds))
        splits["memory-only"] = tuple(Stage(h.name, n.start, n.end) for h, n in zip(speeds, fit))
        checks = _brute_checks(speeds, cfg.n_layers, need, links, splits, row_bytes)
        orders = [tuple(s.host for s in splits[k]) for k in ("planned (latency)", "planned (throughput)")]
        orders += grid_orders(speeds, cfg.n_layers, need, links, row_bytes)
        rows, ran = [], {}
        for name, stages in list(splits.items()) + _grid(orders, by_name, cfg.n_layers, links, args, row_bytes):
            if stages in ran:   # run once; a named split that is another's (a tie-break's plan) shares its row
                rows += [] if name.startswith("grid") else [{**ran[stages], "split": name}]
                continue
            if name.startswith("grid") and time.perf_counter() - t_start > args.budget_s:
                break
            speed = round(machine / machine_ms(), 3)    # > 1: the machine runs this row faster than it measured
            ran[stages] = {**run_split(name, stages, hosts, model, weights, tmp, predict(
                stages, by_name, cfg.n_layers, links, STREAMS, row_bytes), not args.one_stream), "machine_speed": speed}
            rows.append(ran[stages])
    return _report(args, tables, rows, measured, checks, netns_why, load, t_start, ring)


def _stored(model: Path) -> str:
    from skippy_zmq.checkpoint.checkpoint import stored_weights

    return stored_weights(model)


def _grid(orders: list[tuple[str, ...]], by_name: dict[str, HostSpeed], n_layers: int, links: Links,
          args: argparse.Namespace, row_bytes: int = 0) -> list[tuple[str, tuple[Stage, ...]]]:
    """Grid splits in every order given of two hosts or more, best predicted first (latency and
    throughput in turn)."""
    step = max(1, args.grid)
    candidates = {g for order in orders if len(order) > 1 for g in grid_splits(list(order), n_layers, step)}
    by_lat = sorted(candidates, key=lambda g: predict(g, by_name, n_layers, links, STREAMS, row_bytes).ms_per_token_1)
    by_thr = sorted(candidates, key=lambda g: -predict(g, by_name, n_layers, links, STREAMS, row_bytes).tok_s_n)
    order = [g for pair in zip(by_lat, by_thr) for g in pair]
    return [(f"grid {_label(g)}", g) for g in order]


def _brute_checks(speeds: list[HostSpeed], n_layers: int, need: Any, links: Links,
                  splits: dict[str, tuple[Stage, ...]], row_bytes: int = 0) -> list[dict[str, Any]]:
    """The planner against brute force over every order and cut of as many hosts as it may use, in prediction
    (the plan may trail it by speed.TIE where a tie went to the other objective, FEWER to fewer stages)."""
    from skippy_zmq.ops.speed import objective_ms

    by_name = {h.name: h for h in speeds}
    out = []
    for objective, key in (("latency", "planned (latency)"), ("throughput", "planned (throughput)")):
        t0 = time.perf_counter()
        best = brute_force(speeds, n_layers, need, links, objective, STREAMS, PLAN_STAGES.get(objective, len(speeds)),
                           row_bytes).stages
        out.append({"objective": objective, "planned": _label(splits[key]), "brute_force": _label(best),
                    "planned_ms": round(objective_ms(splits[key], by_name, n_layers, links, objective, STREAMS,
                                                     row_bytes), 3),
                    "brute_force_ms": round(objective_ms(best, by_name, n_layers, links, objective, STREAMS,
                                                         row_bytes), 3),
                    "brute_force_s": round(time.perf_counter() - t0, 1)})
    return out


def _label(stages: Sequence[Stage]) -> str:
    return " / ".join(f"{s.host}:{s.end - s.start}" for s in stages)


def _report(args: argparse.Namespace, tables: list[str], rows: list[dict[str, Any]], measured: list[dict[str, Any]],
            checks: list[dict[str, Any]], netns_why: str | None, load: tuple[float, ...], t_start: float,
            ring: dict[str, float]) -> dict[str, Any]:
    where = "cgroups + network namespaces" if netns_why is None else f"cgroups alone (no namespaces: {netns_why})"
    quota = {spec.name: spec.cpu for spec in HOSTS}
    host_rows = [{"host": m["name"], "cpu_quota_cores": m.get("cpu_quota_cores") or quota.get(m["name"]),
                  "cpu_threads": m.get("cpu_threads"),   # its JAX pool (config/cpus.py: ceil(quota))
                  **{f"{k}_{r}": m["decode"][r][k] for r in ("1", "4", "8") for k in ("layer_ms", "step_ms", "head_ms")},
                  "layer_ms_8_alone": m.get("decode_alone", {}).get("8", {}).get("layer_ms"),
                  "idle_ratio": m.get("idle_ratio"), "burst_ms": m.get("burst_ms"), "rtt_ms": m.get("link", {}).get("rtt_ms"),
                  "link_MB_s": round(m.get("link", {}).get("bytes_per_s", 0) / 1e6, 1),
                  "prefill_layer_ms_per_token": m["prefill"]["layer_ms_per_token"], "measure_s": m["measure_s"]}
                 for m in measured]
    cpu = measured[0].get("cpu", "?")
    tables.append(print_table(f"cluster: hosts as measured ({cpu}, {measured[0].get('cores')} cores; {where}; "
                              f"load average {load[0]:.1f} at the start)", host_rows,
                              "cluster/measure.py inside each host's cgroup: per decoder layer, per step, the head "
                              "(last stage), at 1 row with the host alone, at 4 and 8 rows the mean of alone and with "
                              "every host measuring at once (alone: layer_ms_8_alone); medians of round-robin samples; "
                              "idle_ratio, burst_ms: the quota's burst (measure.quota_burst)."))
    tables.append(print_table(f"cluster: splits, 1 stream and {STREAMS} streams, predicted beside measured "
                              f"({NEW_TOKENS} new tokens, {PROMPT_TOKENS}-token prompts)", rows,
                              "ms_per_token_1: median inter-token ms at 1 stream; tok_s_8: steady aggregate tok/s "
                              f"at {STREAMS} streams; predictions: ops/speed.py from the measurements."))
    tables.append(print_table("cluster: the planner against brute force over every order and cut (predicted)",
                              checks))
    goals = goal_rows(rows)
    tables.append(print_table("cluster: goals (issue 40)", goals))
    tables.append(print_table("cluster: a token outside the stages (one-stage ring on the fastest host)", [ring],
                              "driver_ms: the driver loop's own time a token; hop_fixed_ms: each hop's software "
                              "beside its link; both charged by ops/speed.py to every split."))
    result = {"hosts": measured, "splits": rows, "brute_force": checks, "goals": goals, "where": where, "ring": ring,
              "load_avg": [round(v, 2) for v in load], "load_avg_end": [round(v, 2) for v in os.getloadavg()],
              "elapsed_s": round(time.perf_counter() - t_start, 1)}
    return result
