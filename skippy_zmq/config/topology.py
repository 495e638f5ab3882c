"""Topology YAML -> validated, frozen dataclasses; layer planning.

Schema (every key except ``model`` and each stage's ``id``/``layers``/``listen``
is optional; defaults shown)::

    model: models/smollm2-135m-instruct  # checkpoint dir; a relative path resolves
                                         # against the CURRENT WORKING DIRECTORY of
                                         # the process, not against this file
    n_layers: 30          # optional; when given, the last stage must end here
    security: curve       # curve | none (none: unauthenticated links, logged at WARNING by every process)
    keys_dir: null        # CURVE key folder (same path rule as model); default: made on first launch in
                          # ~/.local/state/skippy_zmq/keys/<digest> (keystore.py); a stage on another
                          # host needs that folder copied to the same path there
    driver:
      return: tcp://127.0.0.1:5600   # ROUTER bound by the driver; stages connect
      return_advertise: null         # the endpoint stages dial when it is not `return` (a port
                                     # forward, NAT, a relay); default: `return`
      http: 127.0.0.1:8000           # host:port of the OpenAI API
      max_sessions: 8                # concurrent requests admitted
      max_queue: 64                  # requests waiting for admission
      request_timeout_s: 120
      reply_timeout_s: 30            # bound on any wait for a stage reply
      heartbeat_s: 0.5
      dead_after_s: 2.0              # must exceed heartbeat_s
      resume_timeout_s: 60           # wait this long for a dead stage's replacement, then 503
      prefill_chunk: 256
      max_context: 2048              # prompt + generated tokens per session
      micro_batches: 0               # decode micro-batches in flight (0 = one per stage)
      max_body_bytes: 4194304        # HTTP request body limit
      http_edge:                     # who may call the HTTP API and how much a caller may hold:
                                     # allowed_hosts, allowed_origins, metrics_public, max_connections,
                                     # max_connections_per_client, header_timeout_s, body_timeout_s,
                                     # keep_alive_s, max_header_bytes; see skippy_zmq/config/http.py
      speculative:                   # driver-side drafts (n-gram lookup), verified by the target
        method: off                  # off | ngram
        max_draft: 15                # most drafted tokens per window (1..32)
        # min_draft, min_match, max_match, shared, shared_tokens, min_acceptance,
        # probe_every: see skippy_zmq/engine/speculative.py
    wire:
      activation_dtype: f32          # f32 | f16 | bf16 | q8
      max_message_bytes: 67108864
      hwm: 1000                      # ZeroMQ high-water mark (0 = unlimited)
    stages:                          # in chain order
      - id: s0
        layers: [0, 15]              # half-open [start, end); contiguous from 0
        listen: tcp://127.0.0.1:5601 # PULL bound by the stage (tcp/ipc/inproc)
        host: 127.0.0.1              # where scripts spawn it; default: listen's host
        advertise: null              # the endpoint peers dial when it is not `listen` (a port
                                     # forward, NAT, a relay); default: listen, a wildcard host as `host`
        device: cpu                  # cpu | gpu:N | tpu:N
        dtype: float32               # float32 | bfloat16
        weights: auto                # auto (the checkpoint's format) | gguf | f32 | bf16 | int8 | q4: the
                                     # checkpoint's format or a coarser one (gguf: a GGUF's own blocks)
                                     # (int8 / q4: weight-only, groups of 32, the native kernel on CPU)
        kv_dtype: f32                # f32 | bf16 KV cache (bf16: half the memory); default: bf16 if dtype is
                                     # bfloat16, else f32
        kv_lanes: 8                  # sessions held at once; default driver.max_sessions
        cpus: [0]                    # pin the stage to these CPUs (its XLA pool sizes to them); default: all
        memory: 6GiB                 # the stage's byte budget (an integer or KB/MB/GB, KiB/MiB/GiB units):
                                     # it refuses to start when placement.py predicts more; default: none
        cache:                       # prefix store
          mode: lookup-record        # disabled | record | lookup-record
          max_bytes: 268435456
          max_entries: 256
          stride: 128
          min_tokens: 64

Every error is a ``TopologyError`` naming the file and the key path, e.g.
``topologies/x.yaml: stages[1].layrs: unknown key (allowed: ...)``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import yaml

from skippy_zmq.config.http import EdgeConfig, EdgeConfigError
from skippy_zmq.config.speculative import SpeculativeConfig, SpeculativeConfigError
from skippy_zmq.config.units import parse_bytes

DEFAULT_MODEL = "models/smollm2-135m-instruct"


LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}


def is_local(host: str) -> bool:
    """A stage host that names this machine (its processes are started here, not over ssh)."""
    return host in LOCAL_HOSTS or host == socket.gethostname()


class TopologyError(ValueError):
    """A topology file (or dict) is malformed; the message names file and key."""


@dataclass(frozen=True)
class CacheConfig:
    mode: str = "lookup-record"
    max_bytes: int = 256 << 20
    max_entries: int = 256
    stride: int = 128
    min_tokens: int = 64

    @property
    def lookup(self) -> bool:
        return self.mode == "lookup-record"

    @property
    def record(self) -> bool:
        return self.mode != "disabled"


@dataclass(frozen=True)
class StageConfig:
    id: str
    start: int
    end: int
    listen: str
    n_layers: int  # the whole model's layer count, so a stage knows if it is last
    host: str = "127.0.0.1"
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = "auto"              # auto (the checkpoint's) | gguf | f32 | bf16 | int8 | q4 (stored or coarser)
    kv_lanes: int = 8
    kv_dtype: str = "f32"              # KV cache values: f32 | bf16
    cache: CacheConfig = CacheConfig()
    cpus: tuple[int, ...] = ()         # CPU affinity of the stage process; () = leave it unpinned
    memory: int | None = None          # byte budget of the stage process (placement.py); None = unbounded
    advertise: str | None = None       # the endpoint peers dial, when it is not `listen`

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.n_layers

    @property
    def connect(self) -> str:
        """The endpoint a peer dials: `advertise`, else `listen` with a wildcard bind host as `host`."""
        if self.advertise is not None:
            return self.advertise
        return re.sub(r"^tcp://(\*|0\.0\.0\.0):", f"tcp://{self.host}:", self.listen)


@dataclass(frozen=True)
class DriverConfig:
    return_endpoint: str = "tcp://127.0.0.1:5600"
    return_advertise: str | None = None   # the endpoint stages dial, when it is not `return`
    http: str = "127.0.0.1:8000"
    max_sessions: int = 8
    max_queue: int = 64
    request_timeout_s: float = 120.0
    reply_timeout_s: float = 30.0
    heartbeat_s: float = 0.5
    dead_after_s: float = 2.0
    resume_timeout_s: float = 60.0     # requests wait this long for a dead stage's replacement
    prefill_chunk: int = 256
    max_context: int = 2048
    micro_batches: int = 0             # decode micro-batches in flight; 0 = one per stage
    max_body_bytes: int = 4 << 20      # HTTP request body limit
    http_edge: EdgeConfig = EdgeConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @property
    def return_connect(self) -> str:
        """The endpoint a stage dials to reach the driver's ROUTER."""
        return self.return_advertise or self.return_endpoint

    @property
    def http_host(self) -> str:
        return self.http.rsplit(":", 1)[0].strip("[]")

    @property
    def http_port(self) -> int:
        return int(self.http.rsplit(":", 1)[1])


@dataclass(frozen=True)
class WireConfig:
    activation_dtype: str = "f32"
    max_message_bytes: int = 64 << 20
    hwm: int = 1000


@dataclass(frozen=True)
class Topology:
    model: str
    n_layers: int  # as declared, else the last stage's end
    stages: tuple[StageConfig, ...]
    security: str = "curve"
    keys_dir: str | None = None
    driver: DriverConfig = DriverConfig()
    wire: WireConfig = WireConfig()
    # Derived / provenance: not part of equality, so dump -> parse round-trips.
    model_path: Path = field(default=Path(), compare=False)
    source: str = field(default="<dict>", compare=False)

    @property
    def first(self) -> StageConfig:
        return self.stages[0]

    @property
    def last(self) -> StageConfig:
        return self.stages[-1]

    def is_first(self, stage: StageConfig) -> bool:
        return stage.id == self.stages[0].id

    def is_last(self, stage: StageConfig) -> bool:
        return stage.id == self.stages[-1].id

    def index(self, stage_id: str) -> int:
        for i, stage in enumerate(self.stages):
            if stage.id == stage_id:
                return i
        ids = ", ".join(s.id for s in self.stages)
        raise KeyError(f"{self.source}: no stage {stage_id!r} (stages: {ids})")

    def stage(self, stage_id: str) -> StageConfig:
        return self.stages[self.index(stage_id)]

    def next_stage(self, stage_id: str) -> StageConfig | None:
        i = self.index(stage_id) + 1
        return self.stages[i] if i < len(self.stages) else None

    def check_model(self, n_layers: int) -> None:
        """Raise unless the stages cover exactly [0, n_layers) of the model."""
        if self.last.end != n_layers:
            raise TopologyError(
                f"{self.source}: stages cover layers [0, {self.last.end}) but the model has {n_layers} layers"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "n_layers": self.n_layers, "security": self.security}
        if self.keys_dir is not None:
            out["keys_dir"] = self.keys_dir
        driver = dataclasses.asdict(self.driver)
        out["driver"] = {"return": driver.pop("return_endpoint"), **driver}
        out["wire"] = dataclasses.asdict(self.wire)
        out["stages"] = [
            {"id": s.id, "layers": [s.start, s.end], "listen": s.listen, "host": s.host, "device": s.device,
             "dtype": s.dtype, "weights": s.weights, "kv_lanes": s.kv_lanes, "kv_dtype": s.kv_dtype,
             "cache": dataclasses.asdict(s.cache),
             **({"cpus": list(s.cpus)} if s.cpus else {}), **({"memory": s.memory} if s.memory else {}),
             **({"advertise": s.advertise} if s.advertise else {})}
            for s in self.stages
        ]
        return out


# ---------------------------------------------------------------- validation


@dataclass(frozen=True)
class _At:
    """Where in which file a value sits, for error messages."""

    source: str
    path: str = ""

    def key(self, key: Any) -> _At:
        return _At(self.source, f"{self.path}.{key}" if self.path else str(key))

    def item(self, i: int) -> _At:
        return _At(self.source, f"{self.path}[{i}]")

    def fail(self, message: str) -> NoReturn:
        raise TopologyError(f"{self.source}: {self.path}: {message}" if self.path else f"{self.source}: {message}")


Check = Callable[[Any, _At], Any]
_TCP = re.compile(r"^tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d+)$")


def _integer(low: int) -> Check:
    def check(value: Any, at: _At) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            at.fail(f"expected an integer, got {value!r}")
        if value < low:
            at.fail(f"must be at least {low}, got {value}")
        return value

    return check


def _cpus(value: Any, at: _At) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or \
            not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value):
        at.fail(f"expected a non-empty list of CPU numbers, got {value!r}")
    if len(set(value)) != len(value):
        at.fail(f"lists a CPU twice: {value!r}")
    return tuple(value)


def _memory(value: Any, at: _At) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        at.fail(str(exc))


def _seconds(value: Any, at: _At) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        at.fail(f"expected a number, got {value!r}")
    if not 0 < value < math.inf:
        at.fail(f"must be a positive number, got {value}")
    return float(value)


def _text(value: Any, at: _At) -> str:
    if not isinstance(value, str) or not value.strip():
        at.fail(f"expected a non-empty string, got {value!r}")
    return value


# A stage id names files in the run folder and appears on command lines: a plain name, never a path
# or an option. A host reaches ssh's argv: a hostname, IPv4, [IPv6] (or bare IPv6), with user@.
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SAFE_HOST = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.-]*@)?([A-Za-z0-9_][A-Za-z0-9_.-]{0,252}|\[[0-9A-Fa-f:.]+\]"
                        r"|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*)")


def _stage_id(value: Any, at: _At) -> str:
    if not isinstance(value, str) or not _SAFE_ID.fullmatch(value):
        at.fail(f"expected a name of letters, digits, '_', '.', '-' (not starting with '-' or '.', "
                f"at most 64), got {value!r}")
    return value


def _host(value: Any, at: _At) -> str:
    if not isinstance(value, str) or not _SAFE_HOST.fullmatch(value):
        at.fail(f"expected a hostname, IPv4, [IPv6] or user@host (no leading '-', no spaces), got {value!r}")
    return value


def _choice(*options: str) -> Check:
    def check(value: Any, at: _At) -> str:
        if value not in options:
            at.fail(f"expected one of {', '.join(options)}, got {value!r}")
        return value

    return check


def _device(value: Any, at: _At) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"cpu|(gpu|tpu):\d+", value):
        at.fail(f"expected cpu, gpu:N or tpu:N, got {value!r}")
    return value


def _port(port: str, at: _At) -> int:
    if not 1 <= int(port) <= 65535:
        at.fail(f"port {port} is outside 1..65535")
    return int(port)


def _endpoint(value: Any, at: _At) -> str:
    if isinstance(value, str) and (m := _TCP.match(value)):
        _port(m["port"], at)
    elif not (isinstance(value, str) and re.fullmatch(r"(ipc|inproc)://\S+", value)):
        at.fail(f"expected tcp://host:port, ipc://path or inproc://name, got {value!r}")
    return value


def _dial(value: Any, at: _At) -> str | None:
    """An endpoint a peer can dial (no wildcard host), or null for the default."""
    if value is None:
        return None
    m = _TCP.match(_endpoint(value, at))
    if m and m["host"] in ("*", "0.0.0.0"):
        at.fail(f"a peer cannot dial the wildcard host of {value!r}; name the host")
    return value


def _hostport(value: Any, at: _At) -> str:
    if not (isinstance(value, str) and (m := _TCP.match(f"tcp://{value}")) and m["host"] != "*"):
        at.fail(f"expected host:port, got {value!r}")
    _port(m["port"], at)
    return value


def _layers(value: Any, at: _At) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
        at.fail(f"expected [start, end] (two integers, end exclusive), got {value!r}")
    start, end = value
    if not 0 <= start < end:
        at.fail(f"[{start}, {end}) is empty or negative: need 0 <= start < end")
    return start, end


def _read(raw: Any, at: _At, checks: dict[str, Check], defaults: dict[str, Any]) -> dict[str, Any]:
    """Check one mapping against `checks`; missing keys take `defaults` (absent there = required)."""
    if not isinstance(raw, dict):
        at.fail(f"expected a mapping, got {raw!r}")
    for key in raw:
        if key not in checks:
            at.key(key).fail(f"unknown key (allowed: {', '.join(sorted(checks))})")
    out = {}
    for key, check in checks.items():
        if key in raw:
            out[key] = check(raw[key], at.key(key))
        elif key in defaults:
            out[key] = defaults[key]
        else:
            at.key(key).fail("required key is missing")
    return out


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def _section(cls: type, checks: dict[str, Check]) -> Check:
    """A check for a nested mapping whose keys are exactly `cls`'s fields."""
    return lambda raw, at: cls(**_read(raw, at, checks, _defaults(cls)))


_cache = _section(CacheConfig, {
    "mode": _choice("disabled", "record", "lookup-record"), "max_bytes": _integer(1), "max_entries": _integer(1),
    "stride": _integer(1), "min_tokens": _integer(1),
})
_wire = _section(WireConfig, {
    "activation_dtype": _choice("f32", "f16", "bf16", "q8"), "max_message_bytes": _integer(1024), "hwm": _integer(0),
})


def _speculative(raw: Any, at: _At) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_dict(raw)
    except SpeculativeConfigError as err:
        (at.key(err.key) if err.key else at).fail(err.reason)


def _http_edge(raw: Any, at: _At) -> EdgeConfig:
    try:
        return EdgeConfig.from_dict(raw)
    except EdgeConfigError as err:
        (at.key(err.key) if err.key else at).fail(err.reason)


def _driver(raw: Any, at: _At) -> DriverConfig:
    checks = {"return": _endpoint, "return_advertise": _dial, "http": _hostport, "max_sessions": _integer(1),
              "max_queue": _integer(0),
              "request_timeout_s": _seconds, "reply_timeout_s": _seconds, "heartbeat_s": _seconds,
              "dead_after_s": _seconds, "resume_timeout_s": _seconds, "prefill_chunk": _integer(1), "max_context": _integer(1),
              "micro_batches": _integer(0), "max_body_bytes": _integer(1024), "http_edge": _http_edge,
              "speculative": _speculative}
    defaults = _defaults(DriverConfig)
    defaults["return"] = defaults.pop("return_endpoint")
    fields = _read(raw, at, checks, defaults)
    if fields["dead_after_s"] <= fields["heartbeat_s"]:
        at.key("dead_after_s").fail(f"must exceed heartbeat_s ({fields['heartbeat_s']}), got {fields['dead_after_s']}")
    return DriverConfig(return_endpoint=fields.pop("return"), **fields)


_STAGE_CHECKS: dict[str, Check] = {
    "id": _stage_id, "layers": _layers, "listen": _endpoint, "host": _host, "device": _device,
    "dtype": _choice("float32", "bfloat16"), "weights": _choice("auto", "gguf", "f32", "bf16", "int8", "q4"), "kv_lanes": _integer(1),
    "kv_dtype": _choice("f32", "bf16"), "cache": _cache, "cpus": _cpus, "memory": _memory,
    "advertise": _dial,
}


def _stage(raw: Any, at: _At, driver: DriverConfig) -> StageConfig:
    fields = _read(raw, at, _STAGE_CHECKS, _defaults(StageConfig))
    start, end = fields.pop("layers")
    if "host" not in raw:  # spawn where it listens, unless it binds a wildcard
        m = _TCP.match(fields["listen"])
        fields["host"] = m["host"].strip("[]") if m and m["host"] not in ("*", "0.0.0.0") else "127.0.0.1"
        _host(fields["host"], at.key("listen"))
    if "kv_dtype" not in raw:  # a bfloat16 stage keeps a bfloat16 KV unless told otherwise
        fields["kv_dtype"] = "bf16" if fields["dtype"] == "bfloat16" else "f32"
    if "kv_lanes" not in raw:
        fields["kv_lanes"] = driver.max_sessions
    elif fields["kv_lanes"] < driver.max_sessions:
        at.key("kv_lanes").fail(
            f"{fields['kv_lanes']} lanes cannot hold the driver's max_sessions ({driver.max_sessions})"
        )
    return StageConfig(start=start, end=end, n_layers=0, **fields)  # n_layers filled in once the chain is known


def _check_chain(stages: Sequence[StageConfig], at: _At, declared: int | None) -> None:
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


def _check_endpoints(topology: Topology, at: _At) -> None:
    """No two sockets (or the HTTP server) may bind the same address."""
    seen: dict[Any, str] = {}
    d = topology.driver
    places = [("driver.return", d.return_endpoint), ("driver.http", f"tcp://{d.http}")]
    places += [(f"stages[{i}].listen", s.listen) for i, s in enumerate(topology.stages)]
    for path, endpoint in places:
        m = _TCP.match(endpoint)
        key = (m["host"].lower(), int(m["port"])) if m else endpoint
        if key in seen:
            at.fail(f"{path} {endpoint!r} is already used by {seen[key]}")
        seen[key] = path


_TOP_CHECKS: dict[str, Check] = {
    "model": _text, "n_layers": _integer(1), "security": _choice("none", "curve"),
    "keys_dir": lambda v, at: None if v is None else _text(v, at), "driver": _driver, "wire": _wire,
    "stages": lambda v, at: v,  # checked stage by stage in parse_topology
}


def parse_topology(data: Any, source: str = "<dict>") -> Topology:
    """Validate a parsed YAML document into a Topology."""
    at = _At(source)
    top = _read(data, at, _TOP_CHECKS, {"n_layers": None, "security": "curve", "keys_dir": None,
                                        "driver": DriverConfig(), "wire": WireConfig()})
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
