"""`skippy-zmq plan`: a topology YAML for a converted model, split evenly, by relative sizes
(--split 2,1,1) or to memory budgets (--memory 6GiB,6GiB,4GiB), with each stage's predicted
bytes as YAML comments (so the output stays valid YAML)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from skippy_zmq.ops import placement
from skippy_zmq.config.model import ModelConfig
from skippy_zmq.config.topology import Topology, TopologyError, dump_topology, plan_topology


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
