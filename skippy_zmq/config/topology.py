"""The topology: frozen dataclasses for the chain of stages, the driver and the wire.

topology_yaml.py reads, checks and writes it (and plans a local one); the schema of its YAML:

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
      run_on: 8                      # the chain decodes up to 8 steps from its own samples before
                                     # the driver's next message: a 1-stage chain runs them itself,
                                     # a longer one sends each from its last stage to its first
                                     # (0: a round through the driver each)
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
    cluster:                         # optional: workers join with a token and fetch their stage's
      listen: tcp://0.0.0.0:5590     # items (listen, advertise, token_ttl_s, max_chunk_bytes; see
                                     # skippy_zmq/config/cluster.py and docs/cluster.md)
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
        idle_warmups: true           # compile, while idle after READY, every shape a request can reach;
                                     # false: such a shape compiles on first use (tests; default: true)
        cache:                       # prefix store
          mode: lookup-record        # disabled | record | lookup-record
          max_bytes: 268435456
          max_entries: 256
          stride: 128
          min_tokens: 64
          max_grid_entries_per_record: 4   # stride-grid prefixes kept per prompt, longest first
          max_grid_entries_per_record: 4   # stride-grid prefixes kept per prompt, longest first

Every error is a ``TopologyError`` naming the file and the key path, e.g.
``topologies/x.yaml: stages[1].layrs: unknown key (allowed: ...)``.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy_zmq.config.cache import CacheConfig
from skippy_zmq.config.cluster import ClusterConfig
from skippy_zmq.config.http import EdgeConfig
from skippy_zmq.config.speculative import SpeculativeConfig

DEFAULT_MODEL = "models/smollm2-135m-instruct"


LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}


def is_local(host: str) -> bool:
    """A stage host that names this machine (its processes are started here, not over ssh)."""
    return host in LOCAL_HOSTS or host == socket.gethostname()


class TopologyError(ValueError):
    """A topology file (or dict) is malformed; the message names file and key."""


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
    # false: after READY the stage compiles no shape the warm-up before READY left out (a shape it has
    # not compiled compiles on first use): for processes whose speed nothing measures (the test suite)
    idle_warmups: bool = True

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


MAX_RUN_ON = 64   # most steps a chain may run on from one DECODE (driver.run_on; stage/run_on.py)


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
    run_on: int = 8                    # steps the chain decodes from its own samples (0 = a round each)
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
    cluster: ClusterConfig | None = None   # workers join with a token (config/cluster.py)
    # Derived / provenance: not part of equality, so dump -> parse round-trips.
    model_path: Path = field(default=Path(), compare=False)
    source: str = field(default="<dict>", compare=False)

    @property
    def first(self) -> StageConfig:
        return self.stages[0]

    @property
    def last(self) -> StageConfig:
        return self.stages[-1]

    @property
    def ring(self) -> bool:
        """The last stage sends each step it runs on straight to the first (stage/run_on.py): the
        first stage's PULL admits the last stage's key too. Any chain of 2 stages or more that runs on."""
        return len(self.stages) > 1 and self.driver.run_on > 0

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
        if self.cluster is not None:
            out["cluster"] = dataclasses.asdict(self.cluster)
        out["stages"] = [
            {"id": s.id, "layers": [s.start, s.end], "listen": s.listen, "host": s.host, "device": s.device,
             "dtype": s.dtype, "weights": s.weights, "kv_lanes": s.kv_lanes, "kv_dtype": s.kv_dtype,
             "cache": dataclasses.asdict(s.cache),
             **({"cpus": list(s.cpus)} if s.cpus else {}), **({"memory": s.memory} if s.memory else {}),
             **({"advertise": s.advertise} if s.advertise else {}),
             **({} if s.idle_warmups else {"idle_warmups": False})}
            for s in self.stages
        ]
        return out
