"""The driver's side of the cluster: workers join with a token, get a stage, fetch its items, start it.

One ROUTER (CURVE server, a keypair of this driver run) on `cluster.listen`, served by one thread
that only moves bytes: it answers each request at once from the checkpoint's files (a read of at
most max_chunk_bytes), and hashing happened before it started (the manifest). Workers are admitted
by a ZAP handler of its own context (TokenAuthenticator): a connection whose key is no live
token's is refused in the handshake, so it can never send a request, let alone receive a byte.

Stages go to workers in the order they join (s0 to the first); a worker that rejoins under its
name gets its stage back. With `split: measured` each worker is first told to MEASURE (from
model.json alone) and no stage is given until as many workers as stages have measured: then the
driver plans host order and cut points from their speed and memory (split.py) and assigns.
Once every stage has a worker the topology is placed (assign.py), the keys are made, and each
worker is told to START its stage; `wait_placed` hands the placed topology to the driver, which
then opens its pipeline as usual.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import re
import threading
import time
from typing import Any, Callable, Collection

import zmq
from loguru import logger
from zmq.utils.monitor import recv_monitor_message

from skippy_zmq.checkpoint.manifest import item_files, load_manifest, model_digest, stage_item_names
from skippy_zmq.cluster import link, peers, token
from skippy_zmq.cluster.assign import placed_topology, stage_key_files
from skippy_zmq.cluster.probe import MAX_PROBE_BYTES
from skippy_zmq.config.cluster import SPLITS, ClusterConfig
from skippy_zmq.config.model import ModelConfig
from skippy_zmq.config.topology import Topology
from skippy_zmq.protocol.security import CurveAuthenticator, SocketSecurity, start_authenticator
from skippy_zmq.protocol.transport import make_socket

MAX_WORKERS = 256
POLL_MS = 100
HANDSHAKE_LOG_EVERY_S = 60.0   # a peer with a wrong driver key retries every 100 ms: log it once a minute
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
WORKER = "worker"   # the ZAP User-Id of every token's connections


class TokenAuthenticator(CurveAuthenticator):
    """Admits a token's key until that token expires; says why it refuses a worker."""

    def __init__(self, ctx: zmq.Context, allowed: dict[bytes, str], expires: dict[bytes, float]):
        super().__init__(ctx, allowed)
        self.expires = expires   # public key -> unix seconds; the server adds tokens as it issues them

    def callback(self, domain: str, key: bytes) -> bool:
        expires = self.expires.get(key)
        if expires is not None and time.time() < expires:
            return True
        reason = (f"its join token expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(expires))}"
                  if expires is not None else "its join token was not issued by this driver (a wrong token, "
                                              "or one from an earlier run of the driver)")
        logger.warning("cluster: refused a worker from {}: {}; it gets nothing", self._peer, reason)
        self.count_rejection()
        return False


@dataclasses.dataclass
class WorkerRecord:
    name: str
    identity: bytes
    address: str
    report: dict[str, Any]
    stage: str | None
    sent_bytes: int = 0
    started: dict[str, Any] | None = None
    measured: dict[str, Any] | None = None   # its measure_host result (split: measured)
    last_seen: float = 0.0                   # monotonic time of its last message (a re-cut's liveness)
    next_files: dict[str, Any] | None = None   # a re-cut's next stage's files: it may fetch these too
    peer_links: dict[str, Any] = dataclasses.field(default_factory=dict)   # PROBED: peer -> its measured link


class ClusterServer:
    """Serve a topology's stages to workers; `close()` when done."""

    def __init__(self, topology: Topology, on_chunk: Callable[[str, int], None] | None = None,
                 split: str | None = None):
        self.topology, self.on_chunk = topology, on_chunk
        self.config = topology.cluster or ClusterConfig()
        self.split = split or self.config.split      # a --cluster-split given on the command line wins
        if self.split not in SPLITS:
            raise ValueError(f"cluster split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        self.planned = self.split == "topology"      # measured: stages are given once the workers measured
        self.model_dir = topology.model_path
        self.manifest = load_manifest(self.model_dir, build=True)
        self.digest = model_digest(self.manifest)
        self.model_cfg = ModelConfig.load(self.model_dir / "model.json")
        self.stage_files = self._stage_files(topology)
        self.workers: dict[str, WorkerRecord] = {}
        self.by_identity: dict[bytes, str] = {}
        self.sent_bytes = 0
        self.placed: Topology | None = None
        self._placed = threading.Event()
        self.changed = threading.Condition()   # notified when a worker joins, is sent a chunk or starts
        self._stop = threading.Event()
        self._expires: dict[bytes, float] = {}
        self.handshake_failures = 0
        self._last_handshake_log = -HANDSHAKE_LOG_EVERY_S
        self.ctx = zmq.Context()       # its own: a ZAP handler serves one context
        public, secret = zmq.curve_keypair()
        self.server_key = public
        self.auth: TokenAuthenticator | None = None
        self.token = self.issue_token()        # before the authenticator, which starts admitting its key
        self.auth = start_authenticator(self.ctx, {self.token.public: WORKER},
                                        make=functools.partial(TokenAuthenticator, expires=self._expires))
        try:
            self.router = make_socket(self.ctx, zmq.ROUTER, self.config.listen, bind=True,
                                      max_message_bytes=link.MAX_WORKER_MESSAGE,
                                      security=SocketSecurity("curve", public, secret, server=True))
        except BaseException:
            self.auth.stop()
            raise
        # Other threads (cluster/rebalance.py) act on the router only through here: a socket has one thread.
        self.posted: queue.Queue[Callable[[], None]] = queue.Queue()
        self.handlers: dict[str, Callable[[bytes, link.Message, str], None]] = {
            "HELLO": self._hello, "FETCH": self._fetch, "STARTED": self._started, "MEASURED": self._measured,
            "PING": self._ping, "PROBED": self._probed,
            "BEAT": lambda *_: None}   # a serving worker's heartbeat: _handle notes when it was last seen
        # split: measured: the workers being planned with, while they measure their links to each
        # other (PROBE/PROBED), with the deadline and the names not yet answered
        self._probing: tuple[list[WorkerRecord], float, set[str]] | None = None
        self.thread = threading.Thread(target=self._serve, name="cluster-server", daemon=True)
        self.thread.start()

    def _stage_files(self, topology: Topology) -> dict[str, dict[str, Any]]:
        return {s.id: item_files(self.manifest, stage_item_names(self.model_cfg, s.start, s.end))
                for s in topology.stages}

    def issue_token(self, ttl_s: float | None = None, expires_at: float | None = None) -> token.JoinToken:
        """A new join token (a keypair of its own), admitted until it expires."""
        ttl = self.config.token_ttl_s if ttl_s is None else ttl_s
        made = token.issue(self.config.connect, self.server_key, ttl)
        if expires_at is not None:
            made = dataclasses.replace(made, expires_at=expires_at)
        self._expires[made.public] = made.expires_at
        if self.auth is not None:
            self.auth.allowed[made.public] = WORKER
        return made

    @property
    def rejected(self) -> int:
        return self.auth.rejected

    def wait_placed(self, timeout: float | None = None) -> Topology | None:
        """The placed topology once every stage has a worker (None on timeout or close)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._placed.wait(0.2):
            if self._stop.is_set() or (deadline is not None and time.monotonic() > deadline):
                return None
        return self.placed

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until `predicate()` holds (checked whenever a worker joins, gets a chunk or starts)."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the server's thread (within POLL_MS), the one that owns its socket."""
        self.posted.put(fn)

    def _run_posted(self) -> None:
        while True:
            try:
                fn = self.posted.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:   # a re-cut's step that fails must not stop the other workers' transfers
                logger.exception("cluster: a posted step failed")
            self._changed()

    def _changed(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.router.close(linger=0)
        self.auth.stop()
        self.ctx.term()

    # ---------------------------------------------------------------- the loop

    def _serve(self) -> None:
        monitor = self.router.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if monitor in ready:
                    self._handshake_failed(recv_monitor_message(monitor))
                if self.router in ready:
                    self._drain()
                self._run_posted()
                if self._probing is not None and time.monotonic() > self._probing[1]:
                    logger.warning("cluster: no link measurement from {} within {:g} s; planning without",
                                   ", ".join(sorted(self._probing[2])), peers.PROBE_WAIT_S)
                    self._plan(self._probing[0])
        finally:
            self.router.disable_monitor()
            monitor.close(linger=0)

    def _handshake_failed(self, event: dict[str, Any]) -> None:
        """A peer that cannot finish the CURVE handshake: a token made for another driver (or an
        earlier run of this one), or not a worker at all. It never reaches the request handlers."""
        self.handshake_failures += 1
        now = time.monotonic()
        if now - self._last_handshake_log >= HANDSHAKE_LOG_EVERY_S:
            self._last_handshake_log = now
            logger.warning("cluster: refused a connection on {} that failed the CURVE handshake (protocol error "
                           "{:#x}): a join token from another driver or an earlier run of this one? ({} so far)",
                           self.config.listen, event.get("value", 0), self.handshake_failures)

    def _drain(self) -> None:
        while True:
            try:
                identity, *parts = self.router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(identity, parts)
            self._changed()

    def _handle(self, identity_frame: zmq.Frame, parts: list[zmq.Frame]) -> None:
        identity = identity_frame.bytes
        try:
            msg = link.parse(parts)
            handler = self.handlers.get(msg.kind)
            name = self.by_identity.get(identity)
            if name is not None:
                self.workers[name].last_seen = time.monotonic()
            if handler is None:
                raise link.LinkError(f"{msg.kind} is not a worker's message")
            address = parts[0].get("Peer-Address") if parts else "?"
            handler(identity, msg, address)
        except (link.LinkError, OSError) as exc:
            logger.warning("cluster: refused a request of worker {}: {}", self.by_identity.get(identity, "?"), exc)
            self._send(identity, link.Message("REFUSED", {"reason": str(exc)[:500]}))
        except Exception:   # a bug or a broken key folder must not stop the other workers' transfers
            logger.exception("cluster: failed to handle a request of worker {}", self.by_identity.get(identity, "?"))
            self._send(identity, link.Message("REFUSED", {"reason": "the driver failed on this request (see its log)"}))

    def _send(self, identity: bytes, msg: link.Message) -> None:
        try:
            self.router.send_multipart([identity, *link.frames(msg)], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("cluster: worker {} is not reading; dropped a {}", self.by_identity.get(identity, "?"),
                           msg.kind)

    def _hello(self, identity: bytes, msg: link.Message, address: str) -> None:
        name = link.field(msg, "name", str)
        if not _NAME.fullmatch(name):
            raise link.LinkError(f"worker name {name[:80]!r}: use letters, digits, '_', '.', ':', '-' (at most 64)")
        report = link.field(msg, "report", dict)
        record = self.workers.get(name)
        if record is None:
            if len(self.workers) >= MAX_WORKERS:
                raise link.LinkError(f"this driver already has {MAX_WORKERS} workers")
            taken = {w.stage for w in self.workers.values()}
            free = [s.id for s in self.topology.stages if s.id not in taken] if self.planned else []
            record = WorkerRecord(name, identity, address, report, free[0] if free else None)
            self.workers[name] = record
        self.by_identity.pop(record.identity, None)
        record.identity, record.address, record.report, record.started = identity, address, report, None
        self.by_identity[identity] = name
        log_join(record)
        record.last_seen = time.monotonic()
        if not self.planned or (self.config.recut and record.stage is None and record.measured is None):
            # a joiner that stands by measures too, so that a re-cut can plan with it
            self._send(identity, link.Message("MEASURE", measure_request(self.topology)))
            return
        self._send(identity, link.Message("ASSIGN", self._assignment(record)))
        if self.placed is None and all(any(w.stage == s.id for w in self.workers.values())
                                       for s in self.topology.stages):
            self._place()
        elif self.placed is not None and record.stage is not None:
            self._start(record)

    def _measured(self, identity: bytes, msg: link.Message, address: str) -> None:
        record = self.workers.get(self.by_identity.get(identity, ""))
        if record is None:
            raise link.LinkError("MEASURED before HELLO")
        speed = msg.header.get("speed")
        if not isinstance(speed, dict):
            raise link.LinkError(f"this driver splits by measured speed and worker {record.name} sent no "
                                 f"measurement ({str(msg.header.get('error', 'none'))[:300]})")
        record.measured = speed
        logger.info("cluster: worker {} measured {:.4f} ms per layer (1 row)", record.name,
                    float(speed.get("decode", {}).get("1", {}).get("layer_ms", 0.0)))
        if self.planned:
            self._send(identity, link.Message("ASSIGN", self._assignment(record)))
            return
        measured = [w for w in self.workers.values() if w.measured is not None]
        if len(measured) >= len(self.topology.stages) and self._probing is None:
            self._probe_then_plan(measured[:len(self.topology.stages)])

    def _probe_then_plan(self, workers: list[WorkerRecord]) -> None:
        """Ask the workers to measure their links to each other (cluster/peers.py), then plan once
        every one answered (or PROBE_WAIT_S passed); at once when fewer than two can be probed."""
        live = [key for key, expires in self._expires.items() if expires > time.time()]
        asks = peers.probe_requests({w.name: (w.address, w.report.get("probe")) for w in workers}, live)
        if not asks:
            self._plan(workers)
            return
        self._probing = (workers, time.monotonic() + peers.PROBE_WAIT_S, set(asks))
        for name, header in asks.items():
            self._send(self.workers[name].identity, link.Message("PROBE", header))

    def _probed(self, identity: bytes, msg: link.Message, address: str) -> None:
        record = self.workers.get(self.by_identity.get(identity, ""))
        if record is None:
            raise link.LinkError("PROBED before HELLO")
        record.peer_links = peers.probed_links(msg)
        logger.info("cluster: worker {} measured its links: {}", record.name, "; ".join(
            f"to {peer} {describe_link(found) if 'rtt_ms' in found else found.get('error')}"
            for peer, found in record.peer_links.items()))
        if self._probing is not None and record.name in self._probing[2]:
            self._probing[2].discard(record.name)
            if not self._probing[2]:
                self._plan(self._probing[0])

    def _plan(self, workers: list[WorkerRecord]) -> None:
        """Split by the workers' measurements (falling back to the topology's split, said why, when
        none fits their memory), give each its stage, and start them."""
        from skippy_zmq.cluster.split import links_of, log_plan, plan_measured
        from skippy_zmq.ops.speed import SpeedPlanError

        self._probing = None
        try:
            split = plan_measured(self.topology, {w.name: w.measured for w in workers}, self.config.objective,
                                  self.config.streams, links_of({w.name: w.report for w in workers},
                                                                {w.name: w.peer_links for w in workers}))
            log_plan(split, self.config.objective)
            self.topology, order = split.topology, split.workers
        except SpeedPlanError as exc:
            logger.error("cluster: no split by measured speed: {}; using the topology's split", exc)
            order = tuple(w.name for w in workers)
        self.stage_files = self._stage_files(self.topology)
        for stage, name in zip(self.topology.stages, order):
            self.workers[name].stage = stage.id
        self.planned = True
        for record in self.workers.values():
            if record.measured is not None:
                self._send(record.identity, link.Message("ASSIGN", self._assignment(record)))
        self._place()

    def _assignment(self, record: WorkerRecord) -> dict[str, Any]:
        if record.stage is None:
            return {"stage": None, "reason": "every stage has a worker; standing by"}
        stage = self.topology.stage(record.stage)
        return {"stage": stage.id, "layers": [stage.start, stage.end], "digest": self.digest,
                "files": self.stage_files[stage.id], "max_chunk_bytes": self.config.max_chunk_bytes}

    def _place(self, kept: Collection[str] = ()) -> None:
        """Place every stage on its worker and START it (not the `kept` ones: a re-cut left them running)."""
        addresses = {w.stage: w.address for w in self.workers.values() if w.stage is not None}
        self.placed = placed_topology(self.topology, addresses)
        logger.info("cluster: every stage has a worker: {}", ", ".join(
            f"{w.stage} on {w.name} ({w.address})" for w in self.workers.values() if w.stage is not None))
        for record in self.workers.values():
            if record.stage is not None and record.stage not in kept:
                self._start(record)
        self._placed.set()

    def _start(self, record: WorkerRecord) -> None:
        assert self.placed is not None and record.stage is not None
        self._send(record.identity, link.Message("START", {
            "stage": record.stage, "topology": self.placed.to_dict(),
            "keys": stage_key_files(self.placed, record.stage)}))

    def _fetch(self, identity: bytes, msg: link.Message, address: str) -> None:
        record = self.workers.get(self.by_identity.get(identity, ""))
        if record is None or (record.stage is None and record.next_files is None):
            raise link.LinkError("FETCH before HELLO, or from a worker with no stage")
        rel = link.field(msg, "path", str)
        entry = (self.stage_files[record.stage].get(rel) if record.stage is not None else None) \
            or (record.next_files or {}).get(rel)
        if entry is None:
            raise link.LinkError(f"{rel[:200]!r} is not a file of stage {record.stage}")
        offset = link.field(msg, "offset", int, 0)
        length = link.field(msg, "length", int, 1)
        if length > self.config.max_chunk_bytes or offset + length > entry["bytes"]:
            raise link.LinkError(f"{rel}: [{offset}, +{length}) is past its {entry['bytes']} bytes or over "
                                 f"the chunk cap ({self.config.max_chunk_bytes})")
        fd = os.open(self.model_dir / rel, os.O_RDONLY)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        self._send(identity, link.Message("CHUNK", {"path": rel, "offset": offset}, data))
        record.sent_bytes += len(data)
        self.sent_bytes += len(data)
        if self.on_chunk is not None:
            self.on_chunk(record.name, record.sent_bytes)

    def _ping(self, identity: bytes, msg: link.Message, address: str) -> None:
        """A worker measuring its link (cluster/probe.py): `size` zero bytes back at once (capped);
        answered before HELLO too, since a worker reports the link in its HELLO."""
        size = link.field(msg, "size", int, 0)
        if size > MAX_PROBE_BYTES:
            raise link.LinkError(f"PING: size {size} is over the probe cap ({MAX_PROBE_BYTES})")
        self._send(identity, link.Message("PONG", {"size": size}, bytes(size) if size else None))

    def _started(self, identity: bytes, msg: link.Message, address: str) -> None:
        name = self.by_identity.get(identity)
        if name is None:
            raise link.LinkError("STARTED before HELLO")
        self.workers[name].started = msg.header
        logger.info("cluster: worker {} started stage {} (pid {}), fetched {} bytes{}", name,
                    msg.header.get("stage"), msg.header.get("pid"), msg.header.get("fetched_bytes"),
                    f", speed {msg.header['speed']}" if msg.header.get("speed") else "")


def measure_request(topology: Topology) -> dict[str, Any]:
    """What a worker measures with (MEASURE): the model's model.json and the format, dtype and
    device its stages run."""
    from skippy_zmq.checkpoint.checkpoint import resolve_weights

    stage = topology.stages[0]
    return {"model_json": (topology.model_path / "model.json").read_text(), "dtype": stage.dtype,
            "weights": resolve_weights(topology.model_path, stage.weights), "device": stage.device}


def log_join(record: WorkerRecord) -> None:
    r = record.report
    mem = r.get("memory") if isinstance(r.get("memory"), dict) else {}
    devices = r.get("devices") if isinstance(r.get("devices"), list) else []
    kinds = ", ".join(str(d.get("kind", "?")) for d in devices if isinstance(d, dict)) or "unknown"
    gib = 1 << 30
    logger.info("cluster: worker {} joined from {}: {} cores, memory {:.1f} GiB ({:.1f} available), {:.1f} GiB "
                "free disk, devices: {}; link to the driver: {}; stage: {}", record.name, record.address,
                r.get("cores"), (mem.get("total") or 0) / gib, (mem.get("available") or 0) / gib,
                (r.get("disk_free") or 0) / gib, kinds, describe_link(driver_link(r)),
                record.stage or "none (standing by)")


def driver_link(report: dict[str, Any]) -> dict[str, Any] | None:
    """The worker's measured link to the driver from its report (None: it sent none, or a bad one)."""
    links = report.get("links")
    found = links.get("driver") if isinstance(links, dict) else None
    ok = isinstance(found, dict) and all(isinstance(found.get(k), (int, float)) and found[k] > 0
                                         for k in ("rtt_ms", "bytes_per_s"))
    return found if ok else None


def describe_link(found: dict[str, Any] | None) -> str:
    if found is None:
        return "not measured"
    return f"round trip {found['rtt_ms']:.3f} ms, {found['bytes_per_s'] / 1e6:.1f} MB/s"
