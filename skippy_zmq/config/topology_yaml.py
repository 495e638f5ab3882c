"""Topology YAML -> a validated Topology (parse_topology, load_topology), back to YAML
(dump_topology), and a local topology planned from a layer count (plan_topology).

Every error is a TopologyError naming the file and the key path (checks.At)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path
from typing import Any, Sequence

import yaml

from skippy_zmq.config import checks
from skippy_zmq.config.cache import CACHE_MODES
from skippy_zmq.config.cluster import OBJECTIVES, SPLITS, ClusterConfig
from skippy_zmq.config.http import EdgeConfig, EdgeConfigError
from skippy_zmq.config.speculative import SpeculativeConfig, SpeculativeConfigError
from skippy_zmq.config.topology import (DEFAULT_MODEL, MAX_RUN_ON, CacheConfig, DriverConfig, StageConfig, Topology,
                                        TopologyError, WireConfig)


_cache = checks.section(CacheConfig, {
    "mode": checks.choice(*CACHE_MODES), "max_bytes": checks.integer(1), "max_entries": checks.integer(1),
    "stride": checks.integer(1), "min_tokens": checks.integer(1), "max_grid_entries_per_record": checks.integer(0),
})
_wire = checks.section(WireConfig, {
    "activation_dtype": checks.choice("f32", "f16", "bf16", "q8"), "max_message_bytes": checks.integer(1024),
    "hwm": checks.integer(0),
})


def _tcp(value: Any, at: checks.At) -> str:
    if not (isinstance(value, str) and checks.TCP.match(value)):
        at.fail(f"expected tcp://host:port, got {value!r}")
    return checks.endpoint(value, at)


def _chunk_bytes(value: Any, at: checks.At) -> int:
    if checks.integer(4096)(value, at) > 16 << 20:   # a worker's socket takes frames up to 64 MiB
        at.fail(f"must be at most {16 << 20} (16 MiB), got {value}")
    return value


def _flag(value: Any, at: checks.At) -> bool:
    if not isinstance(value, bool):
        at.fail(f"must be true or false, got {value!r}")
    return value


def _recut_threshold(value: Any, at: checks.At) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value == 0 or value > 1):
        at.fail(f"must be 0 (never re-cut on drift) or a factor above 1, got {value!r}")
    return float(value)


_cluster = checks.section(ClusterConfig, {
    "listen": _tcp, "advertise": lambda v, at: None if v is None else checks.dial(_tcp(v, at), at),
    "token_ttl_s": checks.seconds, "max_chunk_bytes": _chunk_bytes,
    "split": checks.choice(*SPLITS), "objective": checks.choice(*OBJECTIVES), "streams": checks.integer(1),
    "recut": _flag, "recut_threshold": _recut_threshold, "recut_window_s": checks.seconds,
    "recut_payback_s": checks.seconds, "gone_after_s": checks.seconds,
})


def _speculative(raw: Any, at: checks.At) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_dict(raw)
    except SpeculativeConfigError as err:
        (at.key(err.key) if err.key else at).fail(err.reason)


def _http_edge(raw: Any, at: checks.At) -> EdgeConfig:
    try:
        return EdgeConfig.from_dict(raw)
    except EdgeConfigError as err:
        (at.key(err.key) if err.key else at).fail(err.reason)


def _driver(raw: Any, at: checks.At) -> DriverConfig:
    by_key = {"return": checks.endpoint, "return_advertise": checks.dial, "http": checks.hostport,
              "max_sessions": checks.integer(1), "max_queue": checks.integer(0),
              "request_timeout_s": checks.seconds, "reply_timeout_s": checks.seconds, "heartbeat_s": checks.seconds,
              "dead_after_s": checks.seconds, "resume_timeout_s": checks.seconds, "prefill_chunk": checks.integer(1),
              "max_context": checks.integer(1), "micro_batches": checks.integer(0),
              "run_on": checks.integer(0, MAX_RUN_ON),
              "max_body_bytes": checks.integer(1024), "http_edge": _http_edge, "speculative": _speculative}
    defaults = checks.dataclass_defaults(DriverConfig)
    defaults["return"] = defaults.pop("return_endpoint")
    fields = checks.read_mapping(raw, at, by_key, defaults)
    if fields["dead_after_s"] <= fields["heartbeat_s"]:
        at.key("dead_after_s").fail(f"must exceed heartbeat_s ({fields['heartbeat_s']}), got {fields['dead_after_s']}")
    return DriverConfig(return_endpoint=fields.pop("return"), **fields)


_STAGE_CHECKS: dict[str, checks.Check] = {
    "id": checks.stage_id, "layers": checks.layers, "listen": checks.endpoint, "host": checks.host,
    "device": checks.device, "dtype": checks.choice("float32", "bfloat16"),
    "weights": checks.choice("auto", "gguf", "f32", "bf16", "int8", "q4"), "kv_lanes": checks.integer(1),
    "kv_dtype": checks.choice("f32", "bf16"), "cache": _cache, "cpus": checks.cpus, "memory": checks.memory,
    "advertise": checks.dial, "idle_warmups": _flag,
}


def _stage(raw: Any, at: checks.At, driver: DriverConfig) -> StageConfig:
    fields = checks.read_mapping(raw, at, _STAGE_CHECKS, checks.dataclass_defaults(StageConfig))
    start, end = fields.pop("layers")
    if "host" not in raw:  # spawn where it listens, unless it binds a wildcard
        m = checks.TCP.match(fields["listen"])
        fields["host"] = m["host"].strip("[]") if m and m["host"] not in ("*", "0.0.0.0") else "127.0.0.1"
        checks.host(fields["host"], at.key("listen"))
    if "kv_dtype" not in raw:  # a bfloat16 stage keeps a bfloat16 KV unless told otherwise
        fields["kv_dtype"] = "bf16" if fields["dtype"] == "bfloat16" else "f32"
    if "kv_lanes" not in raw:
        fields["kv_lanes"] = driver.max_sessions
    elif fields["kv_lanes"] < driver.max_sessions:
        at.key("kv_lanes").fail(
            f"{fields['kv_lanes']} lanes cannot hold the driver's max_sessions ({driver.max_sessions})"
        )
    return StageConfig(start=start, end=end, n_layers=0, **fields)  # n_layers filled in once the chain is known


def _check_chain(stages: Sequence[StageConfig], at: checks.At, declared: int | None) -> None:
    """Ids unique; layer ranges contiguous from 0, ending at n_layers when that is declared."""
    previous_end, ids = 0, set()
    for i, stage in enumerate(stages):
        if stage.id in ids:
            at.key("stages").item(i).key("id").fail(f"duplicate stage id {stage.id!r}")
        ids.add(stage.id)
        if i == 0 and stage.start != 0:
            at.fail(f"stages[0].layers starts at {stage.start}; the first stage must start at layer 0")
        if stage.start != previous_end:
            at.fail(f"stages[{i}].layers starts at {stage.start} but the previous stage ends at {previous_end}")
        previous_end = stage.end
    if declared is not None and previous_end != declared:
        at.fail(f"stages[{len(stages) - 1}].layers ends at {previous_end} but n_layers is {declared}")


def _check_endpoints(topology: Topology, at: checks.At) -> None:
    """No two sockets (or the HTTP server) may bind the same address."""
    seen: dict[Any, str] = {}
    d = topology.driver
    places = [("driver.return", d.return_endpoint), ("driver.http", f"tcp://{d.http}")]
    places += [(f"stages[{i}].listen", s.listen) for i, s in enumerate(topology.stages)]
    if topology.cluster is not None:
        places.append(("cluster.listen", topology.cluster.listen))
    for path, endpoint in places:
        m = checks.TCP.match(endpoint)
        key = (m["host"].lower(), int(m["port"])) if m else endpoint
        if key in seen:
            at.fail(f"{path} {endpoint!r} is already used by {seen[key]}")
        seen[key] = path


_TOP_CHECKS: dict[str, checks.Check] = {
    "model": checks.text, "n_layers": checks.integer(1), "security": checks.choice("none", "curve"),
    "keys_dir": lambda v, at: None if v is None else checks.text(v, at), "driver": _driver, "wire": _wire,
    "cluster": lambda v, at: ClusterConfig() if v is None else _cluster(v, at),
    "stages": lambda v, at: v,  # checked stage by stage in parse_topology
}


def parse_topology(data: Any, source: str = "<dict>") -> Topology:
    """Validate a parsed YAML document into a Topology."""
    at = checks.At(source)
    top = checks.read_mapping(data, at, _TOP_CHECKS, {"n_layers": None, "security": "curve", "keys_dir": None,
                                                      "driver": DriverConfig(), "wire": WireConfig(),
                                                      "cluster": None})
    raw_stages = top.pop("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        at.key("stages").fail(f"expected a non-empty list of stages, got {raw_stages!r}")
    stages = [_stage(raw, at.key("stages").item(i), top["driver"]) for i, raw in enumerate(raw_stages)]
    _check_chain(stages, at, top["n_layers"])
    n_layers = top.pop("n_layers") or stages[-1].end
    topology = Topology(n_layers=n_layers, stages=tuple(dataclasses.replace(s, n_layers=n_layers) for s in stages),
                        model_path=Path(top["model"]).resolve(), source=source, **top)
    _check_endpoints(topology, at)
    return topology


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise TopologyError(f"{source}: cannot read topology file: {err.strerror or err}") from err
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise TopologyError(f"{source}: invalid YAML: {err}") from err
    return parse_topology(data, source)


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v,
                                                                flow_style=all(type(x) is int for x in v)))


def dump_topology(topology: Topology) -> str:
    """YAML text that `parse_topology(yaml.safe_load(text))` turns back into an equal Topology."""
    return yaml.dump(topology.to_dict(), Dumper=_Dumper, sort_keys=False)


# ------------------------------------------------------------------ planning


def split_layers(n_layers: int, split: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges proportional to the relative sizes `split`, each >= 1 layer.

    Largest-remainder rounding; ties go to the earliest stage, so an even split
    gives the remainder to the first stages.
    """
    n = len(split)
    if n < 1 or n > n_layers:
        raise TopologyError(f"cannot split {n_layers} layers into {n} stages (need 1 <= stages <= layers)")
    if not all(isinstance(w, numbers.Real) and 0 < w < math.inf for w in split):
        raise TopologyError(f"stage sizes (--split) must be positive finite numbers, got {list(split)}")
    quotas = [n_layers * w / sum(split) for w in split]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(n), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: n_layers - sum(counts)]:
        counts[i] += 1
    while 0 in counts:  # a tiny size still gets one layer, taken from the most over-quota stage
        donor = max((i for i in range(n) if counts[i] > 1), key=lambda i: counts[i] - quotas[i])
        counts[donor] -= 1
        counts[counts.index(0)] += 1
    bounds = [sum(counts[:i]) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def plan_topology(n_layers: int, n_stages: int, split: Sequence[float] | None = None,
                  model: str = DEFAULT_MODEL, base_port: int = 5600, host: str = "127.0.0.1",
                  ranges: Sequence[tuple[int, int]] | None = None, stage_keys: Sequence[dict] | None = None,
                  driver_keys: dict | None = None) -> Topology:
    """A local topology: driver return on `base_port`, stage i listening on `base_port + 1 + i`.

    Layers split by `ranges` when given, else proportionally to `split` (default even);
    `stage_keys[i]` and `driver_keys` add topology keys (weights, memory, max_context...).
    """
    if n_stages < 1:
        raise TopologyError(f"need at least one stage, got {n_stages}")
    if split is not None and len(split) != n_stages:
        raise TopologyError(f"got {len(split)} stage sizes (--split) for {n_stages} stages")
    ranges = list(ranges) if ranges is not None else split_layers(n_layers, split or [1] * n_stages)
    extra = list(stage_keys) if stage_keys is not None else [{}] * n_stages
    data = {
        "model": model, "n_layers": n_layers,
        "driver": {"return": f"tcp://{host}:{base_port}", **(driver_keys or {})},
        "stages": [{"id": f"s{i}", "layers": [start, end], "listen": f"tcp://{host}:{base_port + 1 + i}",
                    "host": host, **extra[i]} for i, (start, end) in enumerate(ranges)],
    }
    return parse_topology(data, source="<plan>")
