"""`skippy-zmq plan`: a topology YAML for a converted model, split evenly, by relative sizes
(--split 2,1,1) or to memory budgets (--memory 6GiB,6GiB,4GiB), with each stage's predicted
bytes as YAML comments (so the output stays valid YAML); or, with `--measure` / `--hosts`, split by
measured speed under memory caps (ops/speed.py), the predictions as comments too."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skippy_zmq.ops import placement
from skippy_zmq.config.model import ModelConfig
from skippy_zmq.config.topology import Topology, TopologyError
from skippy_zmq.config.topology_yaml import dump_topology, parse_topology, plan_topology


@dataclass(frozen=True)
class PlanRequest:
    model: Path
    stages: int | None = None                # None: one per memory budget (or 1)
    split: tuple[float, ...] | None = None   # relative stage sizes
    memory: tuple[int, ...] | None = None    # one byte budget per stage
    weights: str = "auto"                    # "auto": the checkpoint's own format
    dtype: str = "float32"
    kv_dtype: str = "f32"
    context: int = 2048                      # driver.max_context
    lanes: int = 8                           # every stage's kv_lanes and the driver's max_sessions
    cache_bytes: int = 256 * placement.MiB   # every stage's cache.max_bytes; 0 disables the prefix store
    base_port: int = 5700


def stage_count(req: PlanRequest) -> int:
    counts = {n for n in (req.stages, len(req.memory) if req.memory else None,
                          len(req.split) if req.split else None) if n is not None}
    if len(counts) > 1:
        raise TopologyError(f"--stages, --memory and --split disagree on the stage count: {sorted(counts)}")
    return counts.pop() if counts else 1


def settings(req: PlanRequest) -> placement.StageSettings:
    from skippy_zmq.checkpoint.checkpoint import kept_types, resolve_weights, stored_weights

    weights = resolve_weights(req.model, req.weights)
    return placement.StageSettings(weights, req.dtype, req.kv_dtype, req.context, req.lanes, req.cache_bytes,
                                   stored_weights(req.model), types=kept_types(req.model) if weights == "gguf" else None)


def plan(req: PlanRequest) -> tuple[Topology, list[placement.StageNeed]]:
    """The topology and each stage's predicted need; PlacementError when budgets cannot hold it."""
    cfg = ModelConfig.load(Path(req.model) / "model.json")
    n = stage_count(req)
    s = settings(req)
    if req.memory and not req.split:
        needs = placement.fit_layers(cfg, req.memory, [s] * n)
        ranges = [(need.start, need.end) for need in needs]
    else:
        ranges = [(t.start, t.end) for t in plan_topology(cfg.n_layers, n, req.split).stages]
        needs = [placement.stage_need(cfg, a, b, s) for a, b in ranges]
        if req.memory:
            placement.check_fit(needs, req.memory)
    cache = {"max_bytes": req.cache_bytes} if req.cache_bytes else {"mode": "disabled"}
    keys = [{"weights": s.weights, "dtype": req.dtype, "kv_dtype": req.kv_dtype, "kv_lanes": req.lanes,
             "cache": cache, **({"memory": req.memory[i]} if req.memory else {})} for i in range(n)]
    topo = plan_topology(cfg.n_layers, n, model=str(req.model), base_port=req.base_port, ranges=ranges,
                         stage_keys=keys, driver_keys={"max_context": req.context, "max_sessions": req.lanes})
    return topo, needs


def comments(topo: Topology, needs: list[placement.StageNeed]) -> str:
    """One YAML comment line a stage: predicted weights, KV, cache, overhead and total vs budget."""
    lines = ["# predicted bytes per stage (skippy_zmq/ops/placement.py; weights + KV + cache + overhead):"]
    for stage, need in zip(topo.stages, needs):
        budget = f" of {placement.format_bytes(stage.memory)} budget" if stage.memory else ""
        lines.append(f"#   {stage.id} layers [{need.start}, {need.end}): {need.breakdown()}{budget}")
    return "\n".join(lines) + "\n"


def plan_text(req: PlanRequest) -> str:
    topo, needs = plan(req)
    return comments(topo, needs) + dump_topology(topo)


# ---------------------------------------------------------------- by measured speed (ops/speed.py)


@dataclass(frozen=True)
class SpeedRequest:
    """`plan --measure` / `--hosts`: hosts' measurements (cluster/measure.py dicts, each with an
    optional "memory" budget and "address"), link round trips, the objective and stream count."""

    hosts: tuple[dict, ...]
    default_rtt_ms: float = 0.0
    rtt_ms: tuple[tuple[str, str, float], ...] = ()
    objective: str = "latency"
    streams: int = 8
    stages: int | None = None


def read_hosts(path: Path) -> tuple[tuple[dict, ...], float, tuple[tuple[str, str, float], ...]]:
    """A hosts JSON: a list of measurements, or {"hosts": [...], "links": {"default_rtt_ms": x,
    "rtt_ms": {"a->b": y}}}; each host is a measure_host dict or {"name", "memory", "address",
    "measure": {...}}. Memory budgets take placement's units ("6GiB")."""
    import json

    from skippy_zmq.files.filecheck import read_json_capped

    data = read_json_capped(Path(path), "hosts JSON", 1 << 22)
    items, links = (data, {}) if isinstance(data, list) else (data.get("hosts"), data.get("links") or {})
    if not isinstance(items, list) or not items:
        raise TopologyError(f"{path}: expected a non-empty list of hosts (or {{\"hosts\": [...]}})")
    hosts = []
    for item in items:
        if not isinstance(item, dict):
            raise TopologyError(f"{path}: a host is not an object: {json.dumps(item)[:80]}")
        merged = {**item.get("measure", item), **{k: v for k, v in item.items() if k != "measure"}}
        if isinstance(merged.get("memory"), str):
            merged["memory"] = placement.parse_bytes(merged["memory"])
        hosts.append(merged)
    rtt = []
    for key, value in (links.get("rtt_ms") or {}).items():
        a, sep, b = str(key).partition("->")
        if not sep:
            raise TopologyError(f"{path}: links.rtt_ms keys are 'a->b', got {key!r}")
        rtt.append((a.strip(), b.strip(), float(value)))
    return tuple(hosts), float(links.get("default_rtt_ms", 0.0)), tuple(rtt)


def speed_hosts(req: SpeedRequest) -> list:
    """HostSpeed per measurement; its budget: "memory" if given, else the memory it had available."""
    from skippy_zmq.ops.speed import HostSpeed

    return [HostSpeed.from_measure(m, int(m.get("memory") or m.get("memory_available") or 0)) for m in req.hosts]


def plan_speed(req: PlanRequest, speed: SpeedRequest) -> tuple[Topology, list[placement.StageNeed], Any]:
    """The split ops/speed.plan_split finds, as a topology (stage i on its host's address when the
    measurement names one), each stage's need, and the prediction."""
    from skippy_zmq.ops.speed import Links, plan_split

    cfg = ModelConfig.load(Path(req.model) / "model.json")
    s = settings(req)
    hosts = speed_hosts(speed)
    need = lambda a, b: placement.stage_need(cfg, a, b, s).total   # noqa: E731
    # a host's measured link to the driver ("link": {rtt_ms, bytes_per_s}, as a cluster worker or
    # `bench cluster` measures it), the round trips the hosts JSON gives winning
    links = Links.from_driver_links({h.name: m["link"] for h, m in zip(hosts, speed.hosts)
                                     if isinstance(m.get("link"), dict)}, speed.default_rtt_ms,
                                    {(a, b): v for a, b, v in speed.rtt_ms})
    # hops carry f32 activations (the topology written below keeps the default wire)
    pred = plan_split(hosts, cfg.n_layers, need, links, speed.objective, speed.streams, speed.stages, cfg.d_model * 4)
    ranges = [(st.start, st.end) for st in pred.stages]
    by_name = {h.name: (h, m) for h, m in zip(hosts, speed.hosts)}
    cache = {"max_bytes": req.cache_bytes} if req.cache_bytes else {"mode": "disabled"}
    keys = [{"weights": req.weights, "dtype": req.dtype, "kv_dtype": req.kv_dtype, "kv_lanes": req.lanes,
             "cache": cache, **({"memory": by_name[st.host][0].memory} if by_name[st.host][0].memory else {})}
            for st in pred.stages]
    topo = plan_topology(cfg.n_layers, len(ranges), model=str(req.model), base_port=req.base_port, ranges=ranges,
                         stage_keys=keys, driver_keys={"max_context": req.context, "max_sessions": req.lanes})
    data = topo.to_dict()
    for i, st in enumerate(pred.stages):
        address = by_name[st.host][1].get("address")
        if address:
            data["stages"][i].update(host=address, listen=f"tcp://{address}:{req.base_port + 1 + i}")
    topo = parse_topology(data, source="<plan --measure>")
    return topo, [placement.stage_need(cfg, a, b, s) for a, b in ranges], pred


def speed_comments(pred: Any, objective: str) -> str:
    p = pred.to_json()
    lines = [f"# split by measured speed (ops/speed.py), objective {objective}:"]
    for i, (st, one, many) in enumerate(zip(p["stages"], p["stage_ms_1"], p["stage_ms_n"])):
        lines.append(f"#   s{i} on {st['host']}: layers [{st['start']}, {st['end']}), {one:.3f} ms a step at 1 row, "
                     f"{many:.3f} ms at {math.ceil(p['streams'] / len(p['stages']))} rows")
    if p.get("hop_ms_1"):
        lines.append("# hops at 1 row (round trip / 2 + activation / bandwidth): "
                     + ", ".join(f"{ms:.3f} ms" for ms in p["hop_ms_1"]))
    lines.append(f"# predicted: 1 stream {p['ms_per_token_1']:.2f} ms per token ({p['tok_s_1']:.1f} tok/s); "
                 f"{p['streams']} streams {p['tok_s_n']:.1f} tok/s (a round of {p['round_ms_n']:.2f} ms)")
    return "\n".join(lines) + "\n"


def plan_speed_text(req: PlanRequest, speed: SpeedRequest) -> str:
    topo, needs, pred = plan_speed(req, speed)
    return speed_comments(pred, speed.objective) + comments(topo, needs) + dump_topology(topo)
