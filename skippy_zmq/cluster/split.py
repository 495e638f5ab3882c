"""`cluster: {split: measured}`: the workers' measured speeds and memory -> which worker runs which
stage and where the layers are cut (ops/speed.plan_split), as the topology with its layer ranges
rewritten (ids, ports and every other setting kept).

Each worker measures right after it joins, from model.json alone (cluster/measure.py with
source="random": it holds no weights yet), in the weight format the stages run; the driver plans
once as many workers as the topology has stages have measured, then assigns the stages. Each
worker's HELLO carries its measured link to the driver (round trip, bandwidth): hops to and from
a worker cost its link's; before planning, the workers measure their links to each other
(cluster/peers.py) and a hop between two workers costs that (else the slower of their two links
to the driver).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from loguru import logger

from skippy_zmq.config.model import ModelConfig
from skippy_zmq.config.topology import Topology
from skippy_zmq.config.topology_yaml import parse_topology
from skippy_zmq.ops import placement
from skippy_zmq.ops.speed import HostSpeed, Links, Prediction, plan_split

WIRE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8": 1}   # an activation value on the wire (q8: + a scale a row)


@dataclasses.dataclass(frozen=True)
class MeasuredSplit:
    topology: Topology                # the stages' layer ranges rewritten
    workers: tuple[str, ...]          # the worker of stage i
    prediction: Prediction


def stage_settings(topology: Topology) -> placement.StageSettings:
    """What sizes a stage besides its layers, from the topology's first stage and its driver (every
    stage of a cluster topology runs alike; a per-stage `memory` cap is the worker's, not the plan's)."""
    from skippy_zmq.checkpoint.checkpoint import kept_types, resolve_weights, stored_weights

    s = topology.stages[0]
    weights = resolve_weights(topology.model_path, s.weights)
    cache = s.cache.max_bytes if s.cache.mode != "disabled" else 0
    return placement.StageSettings(weights, s.dtype, s.kv_dtype, topology.driver.max_context, s.kv_lanes, cache,
                                   stored_weights(topology.model_path),
                                   prefill_chunk=topology.driver.prefill_chunk,
                                   types=kept_types(topology.model_path) if weights == "gguf" else None)


def host_speed(name: str, measured: Mapping[str, Any]) -> HostSpeed:
    """A worker's measurement as the planner's host: its name, its memory budget the memory it had
    available when it measured (0: unknown, no cap)."""
    return HostSpeed.from_measure(measured, int(measured.get("memory_available") or 0), name=name)


def links_of(reports: Mapping[str, Mapping[str, Any]],
             probed: Mapping[str, Mapping[str, Any]] | None = None) -> Links:
    """Hop costs from the workers' HELLO reports (name -> report with links.driver {rtt_ms,
    bytes_per_s}) and their PROBED links to each other (name -> {peer: {rtt_ms, bytes_per_s}}:
    cluster/peers.py; a pair measured wins over one guessed from the driver links):
    ops/speed.Links.from_driver_links."""
    from skippy_zmq.cluster.peers import pair_links

    found = {}
    for name, report in reports.items():
        links = report.get("links") if isinstance(report, Mapping) else None
        if isinstance(links, Mapping) and isinstance(links.get("driver"), Mapping):
            found[name] = links["driver"]
    pairs = {k: v for k, v in pair_links(probed or {}).items() if k[0] in reports and k[1] in reports}
    return Links.from_driver_links(found, pairs=pairs)


def row_bytes(topology: Topology, d_model: int) -> int:
    """One decode row's activation on the wire (the topology's wire.activation_dtype)."""
    dtype = topology.wire.activation_dtype
    return d_model * WIRE_BYTES.get(dtype, 4) + (4 if dtype == "q8" else 0)


def plan_measured(topology: Topology, measured: Mapping[str, Mapping[str, Any]], objective: str = "latency",
                  streams: int = 8, links: Links = Links()) -> MeasuredSplit:
    """Exactly len(topology.stages) of the `measured` workers (name -> measure_host dict), in the
    order and with the cut points that ops/speed.plan_split finds best (hops costing `links`);
    SpeedPlanError when no split fits their memory."""
    cfg = ModelConfig.load(topology.model_path / "model.json")
    settings = stage_settings(topology)
    hosts = [host_speed(name, m) for name, m in measured.items()]
    need = lambda a, b: placement.stage_need(cfg, a, b, settings).total   # noqa: E731
    pred = plan_split(hosts, cfg.n_layers, need, links, objective, streams, len(topology.stages),
                      row_bytes(topology, cfg.d_model))
    data = topology.to_dict()
    for row, st in zip(data["stages"], pred.stages):
        row["layers"] = [st.start, st.end]
    rewritten = parse_topology(data, source=f"{topology.source} (split by measured speed)")
    return MeasuredSplit(rewritten, tuple(st.host for st in pred.stages), pred)


def log_plan(split: MeasuredSplit, objective: str) -> None:
    p = split.prediction
    logger.info("cluster: split by measured speed (objective {}): {}; predicted {:.2f} ms per token "
                "({:.1f} tok/s) for 1 stream, {:.1f} tok/s for {} streams", objective,
                ", ".join(f"{s.id} [{s.start}, {s.end}) on {w} ({ms:.3f} ms a step)"
                          for s, w, ms in zip(split.topology.stages, split.workers, p.stage_ms_1)),
                p.ms_per_token_1, p.tok_s_1, p.tok_s_n, p.streams)
