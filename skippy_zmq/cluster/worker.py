"""`skippy-zmq worker --join TOKEN`: one per host. It joins the driver named in the token over CURVE,
reports what it has, fetches the checkpoint files of the stage it is given (only those, resuming
partial files, each checked by sha256; cached by model digest, so a restart fetches nothing), then
runs that stage as its child (it dies with the worker: ops/lifetime.py) until it is stopped.

Every wait has a deadline: the join (a refused token is seen in the CURVE handshake and said so),
each chunk (asked again from the same offset, then given up), and the stage's start.
"""

from __future__ import annotations

import hashlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
import zmq
from loguru import logger
from zmq.utils.monitor import recv_monitor_message

from skippy_zmq.checkpoint.manifest import MANIFEST_VERSION, check_manifest
from skippy_zmq.cluster import link, peers
from skippy_zmq.cluster.assign import write_key_files
from skippy_zmq.cluster.cache import CacheError, ModelCache
from skippy_zmq.cluster.next_stage import NextStage
from skippy_zmq.cluster.probe import TRANSFER_BYTES, measure_link
from skippy_zmq.cluster.report import host_report, measure_speed
from skippy_zmq.cluster.token import JoinToken
from skippy_zmq.config.topology import TopologyError
from skippy_zmq.config.topology_yaml import parse_topology
from skippy_zmq.ops.lifetime import STOP_GRACE_S, tied_env
from skippy_zmq.protocol.security import SocketSecurity
from skippy_zmq.protocol.transport import make_socket

DEFAULT_CACHE = Path.home() / ".cache" / "skippy_zmq" / "worker"
FETCH_RETRIES = 3
MAX_MESSAGE_BYTES = 64 << 20
MAX_MODEL_JSON_BYTES = 1 << 20
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# A handshake that fails without a reason is what a wrong driver key looks like from here (the driver
# cannot decrypt us), but a connection broken mid-handshake looks the same once: refuse on the third.
WRONG_KEY_FAILURES = 3
BEAT_S = 1.0   # a serving worker's heartbeat on the cluster link (the driver's gone_after_s judges it)


class Refused(RuntimeError):
    """The driver refused this worker (its token, or a request); the message says why."""


@dataclass(frozen=True)
class WorkerOptions:
    token: JoinToken
    cache: Path = DEFAULT_CACHE
    name: str = ""                     # default: this host's name and a hash of the cache folder
    join_timeout_s: float = 30.0
    reply_timeout_s: float = 30.0
    chunk_bytes: int = 1 << 20
    measure: bool = True               # measure before the stage starts (a driver that splits by measured
                                       # speed has every worker measure before it gives stages, regardless)
    report_devices: bool = True
    stage_args: tuple[str, ...] = field(default=())   # e.g. ("--log-level", "DEBUG") before `stage`
    memory: int = 0                    # the most memory (bytes) this worker offers a split (0: what it has)
    link_probe_bytes: int = TRANSFER_BYTES   # the timed transfer of the link measurement
    probe_listen: str = "tcp://*:0"    # where the other workers probe this one's link ("": nowhere)


def default_name(cache: Path) -> str:
    """This host's name and a hash of the cache folder: the same worker keeps its name over restarts."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{hashlib.sha256(str(cache.resolve()).encode()).hexdigest()[:8]}"


class Worker:
    def __init__(self, options: WorkerOptions):
        self.opts = options
        self.name = options.name or default_name(options.cache)
        self.stop = threading.Event()
        self.fetched_bytes = 0
        self.pending_start: link.Message | None = None
        self.speed: dict[str, Any] | None = None   # measured before any stage (split: measured)
        self.stage_id: str | None = None
        self.cache: ModelCache | None = None
        self.next_stage: str | None = None         # a re-cut's next stage, fetched while this one serves
        self.next_cache: ModelCache | None = None
        self.next_proc: NextStage | None = None    # ... and its process, built before the switch
        self.announced: NextStage | None = None     # the held stage already said PREPARED
        self.ctx = zmq.Context()
        token = options.token
        self.sock = make_socket(self.ctx, zmq.DEALER, token.endpoint, bind=False, max_message_bytes=MAX_MESSAGE_BYTES,
                                security=SocketSecurity("curve", token.public, token.secret, server=False,
                                                        server_key=token.server_key))
        self.monitor = self.sock.get_monitor_socket(_HANDSHAKE_FAILED)
        self.failed_handshakes = 0
        # where the other workers measure their links to this one (cluster/peers.py); its own
        # token's key is admitted until the driver names the others
        self.probe = peers.ProbeServer([token.public], options.probe_listen) if options.probe_listen else None

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()

    # ---------------------------------------------------------------- messages

    def send(self, kind: str, header: dict[str, Any]) -> None:
        """Send within reply_timeout_s: a DEALER whose handshake failed has no peer and would block
        on send for ever, so wait until it can send, watching for the refusal meanwhile."""
        frames = link.frames(link.Message(kind, header))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLOUT)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + self.opts.reply_timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            ready = dict(poller.poll(200))
            if self.monitor in ready:
                self._handshake_failed()
            if ready.get(self.sock, 0) & zmq.POLLOUT:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return
        if self.stop.is_set():
            raise InterruptedError("stopped")
        raise TimeoutError(f"could not send {kind} to the driver at {self.opts.token.endpoint} within "
                           f"{self.opts.reply_timeout_s:g} s")

    def _handshake_failed(self) -> None:
        """A failed CURVE handshake: Refused, unless it may be a connection broken mid-handshake."""
        event = recv_monitor_message(self.monitor)
        self.failed_handshakes += 1
        if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or self.failed_handshakes >= WRONG_KEY_FAILURES:
            raise Refused(self._refusal(event))

    def recv(self, timeout_s: float) -> link.Message | None:
        """The next message within `timeout_s` (None: none came); Refused when the driver refuses us."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set() and (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(min(left, 0.2) * 1000))
            if self.monitor in ready:
                self._handshake_failed()
            if self.sock in ready:
                msg = link.parse(self.sock.recv_multipart(copy=False))
                if msg.kind == "REFUSED":
                    raise Refused(f"the driver refused a request: {msg.header.get('reason', '?')}")
                return msg
        return None

    def _refusal(self, event: dict[str, Any]) -> str:
        token = self.opts.token
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (f"it expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(token.expires_at))}"
                   if token.expired() else "it is not one the driver issued, or it expired by the driver's clock")
            return f"the driver at {token.endpoint} refused this join token: {why}; ask the driver for a new one"
        return (f"the CURVE handshake with {token.endpoint} failed: the token's driver key is not this driver's "
                "(a token from another driver or an earlier run?)")

    def expect(self, kinds: set[str], timeout_s: float, what: str) -> link.Message:
        """The next message of one of `kinds` (a START that comes early is kept for later)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and not self.stop.is_set():
            msg = self.recv(left)
            if msg is None:
                break
            if msg.kind in kinds:
                return msg
            if msg.kind == "START":
                self.pending_start = msg
            elif msg.kind == "PROBE":
                self.probe_peers(msg)
        if self.stop.is_set():
            raise InterruptedError("stopped")
        raise TimeoutError(f"no {what} from the driver at {self.opts.token.endpoint} within {timeout_s:g} s")

    # ---------------------------------------------------------------- steps

    def join(self) -> link.Message:
        report = host_report(self.opts.cache, devices=self.opts.report_devices)
        if self.probe is not None:
            report["probe"] = self.probe.report()
        try:
            report["links"] = {"driver": self.measure_driver_link()}
            self.send("HELLO", {"name": self.name, "protocol": link.PROTOCOL, "report": report})
            msg = self.expect({"ASSIGN", "MEASURE"}, self.opts.join_timeout_s, "answer to this worker's HELLO")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: is the driver running, and is the token (its endpoint) right?") from None
        if msg.kind == "ASSIGN":
            return msg
        self.measure_first(msg)
        # the driver plans once as many workers as stages have measured: no deadline but a stop
        return self.expect({"ASSIGN"}, float("inf"), "ASSIGN after this worker's measurement")

    def measure_driver_link(self) -> dict[str, float]:
        """Round trip and bandwidth to the driver over this (authenticated) link: PINGs answered
        by PONGs of the asked size (cluster/probe.py), each within the join deadline."""
        def ask(size: int) -> None:
            self.send("PING", {"size": size})
            pong = self.expect({"PONG"}, self.opts.join_timeout_s, "PONG")
            got = 0 if pong.data is None else len(pong.data)
            if got != size:
                raise link.LinkError(f"PONG carried {got} bytes, {size} were asked for")

        found = measure_link(ask, transfer_bytes=self.opts.link_probe_bytes)
        logger.info("worker {}: link to the driver: round trip {:.3f} ms, {:.1f} MB/s", self.name,
                    found["rtt_ms"], found["bytes_per_s"] / 1e6)
        return found

    def probe_peers(self, msg: link.Message) -> None:
        """PROBE: admit the driver's token keys on this worker's probe, measure the link to each
        peer it names (cluster/peers.py), answer PROBED with what was found. A malformed PROBE is
        logged and answered with no links (the driver then plans with its guesses): never fatal."""
        token = self.opts.token
        try:
            if self.probe is not None:
                self.probe.allow(peers.allow_keys(msg))
            found = peers.measure_peers(msg, token.public, token.secret, self.opts.link_probe_bytes)
        except link.LinkError as exc:
            logger.warning("worker {}: ignored a PROBE: {}", self.name, exc)
            found = {}
        self.send("PROBED", {"links": found})

    def measure_first(self, msg: link.Message) -> None:
        """The driver splits by measured speed: measure from its model.json alone (no weights here
        yet) in the format the stages run, and send the result (or why there is none)."""
        text = link.field(msg, "model_json", str)
        if len(text) > MAX_MODEL_JSON_BYTES:
            raise link.LinkError(f"MEASURE: model.json is {len(text)} bytes (cap {MAX_MODEL_JSON_BYTES})")
        folder = self.opts.cache / "measure"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.json").write_text(text)
        logger.info("worker {}: measuring this host's speed for the driver's split", self.name)
        self.speed = measure_speed(folder, link.field(msg, "weights", str), link.field(msg, "device", str),
                                   source="random", dtype=link.field(msg, "dtype", str))
        if self.speed and self.opts.memory:
            self.speed["memory_available"] = min(int(self.speed.get("memory_available") or self.opts.memory),
                                                 self.opts.memory)
        self.send("MEASURED", {"speed": self.speed} if self.speed else {"error": "measuring failed (see its log)"})

    def fetch(self, assign: link.Message) -> ModelCache:
        """Every file of the assignment into the cache (only what is missing), verified."""
        cache = ModelCache(self.opts.cache, link.field(assign, "digest", str))
        files = check_manifest({"version": MANIFEST_VERSION, "files": link.field(assign, "files", dict)},
                               "the driver's file table")["files"]
        chunk = min(self.opts.chunk_bytes, link.field(assign, "max_chunk_bytes", int, 1))
        missing = cache.missing(files)
        t0 = time.monotonic()
        for rel in sorted(missing):
            self.fetch_file(cache, rel, missing[rel], chunk)
        seconds = time.monotonic() - t0
        logger.info("worker {}: fetched {} bytes of {} files ({} of {} files were cached) in {:.1f} s", self.name,
                    self.fetched_bytes, len(missing), len(files) - len(missing), len(files), seconds)
        return cache

    def fetch_file(self, cache: ModelCache, rel: str, entry: dict[str, Any], chunk: int) -> None:
        part = cache.open(rel, entry)
        try:
            tries = 0
            while not part.done:
                length = min(chunk, part.size - part.offset)
                self.send("FETCH", {"path": rel, "offset": part.offset, "length": length})
                try:
                    msg = self.expect({"CHUNK"}, self.opts.reply_timeout_s, f"chunk of {rel}")
                except TimeoutError:
                    tries += 1
                    if tries >= FETCH_RETRIES:
                        raise
                    logger.warning("worker {}: no chunk of {} at {} within {:g} s; asking again", self.name, rel,
                                   part.offset, self.opts.reply_timeout_s)
                    continue
                if msg.header.get("path") != rel or msg.header.get("offset") != part.offset:
                    continue     # an answer to a request asked again: already written
                part.append(part.offset, msg.data)
                self.fetched_bytes += len(msg.data)
            part.finish()
        finally:
            part.close()

    def stage_topology(self, start: link.Message, cache: ModelCache, run_dir: Path) -> Path:
        """Write the stage's topology (the placed one, over this worker's model copy and keys)."""
        data = dict(link.field(start, "topology", dict))
        data["model"] = str(cache.dir)
        keys = link.field(start, "keys", dict)
        if keys:
            write_key_files(run_dir / "keys", keys)
            data["keys_dir"] = str(run_dir / "keys")
        path = run_dir / "topology.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        parse_topology(yaml.safe_load(path.read_text()), str(path))   # validated before a stage reads it
        return path

    def start_stage(self, stage_id: str, topology_path: Path, run_dir: Path,
                    prepared: Path | None = None) -> subprocess.Popen:
        log = open(run_dir / f"{stage_id}.log", "ab")
        cmd = [sys.executable, "-m", "skippy_zmq.cli", *self.opts.stage_args, "stage", "--topology",
               str(topology_path), "--stage", stage_id, *(["--prepared", str(prepared)] if prepared else [])]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=tied_env())
        log.close()
        logger.info("worker {}: started stage {} (pid {}), log {}", self.name, stage_id, proc.pid,
                    run_dir / f"{stage_id}.log")
        return proc

    def run(self) -> int:
        assign = self.join()
        stage_id = assign.header.get("stage")
        if stage_id is None:
            logger.info("worker {}: joined; {}", self.name, assign.header.get("reason", "no stage"))
            return self.serve(None)
        logger.info("worker {}: joined; runs stage {} (layers {})", self.name, stage_id, assign.header.get("layers"))
        self.cache = self.fetch(assign)
        self.stage_id = stage_id
        start = self.pending_start or self.expect({"START"}, float("inf"), "START")
        self.pending_start = None
        return self.serve(self.start(start))

    def start(self, start: link.Message) -> subprocess.Popen:
        """START: write the stage's topology over this worker's copy and run the stage (STARTED)."""
        stage_id = link.field(start, "stage", str)
        if stage_id != self.stage_id or self.cache is None:
            raise Refused(f"START names stage {stage_id!r}, but this worker was given {self.stage_id!r}")
        held, self.next_proc = self.next_proc, None
        if held is not None and held.stage_id == stage_id and held.ready():
            proc = held.go()   # built while the old split served: it only opens its ports now
            logger.info("worker {}: stage {} (pid {}) was prepared; it opens its ports", self.name, stage_id, proc.pid)
        else:
            if held is not None:
                held.cancel()
            run_dir = self.run_dir(stage_id)
            topology_path = self.stage_topology(start, self.cache, run_dir)
            stage = parse_topology(yaml.safe_load(topology_path.read_text())).stage(stage_id)
            self.speed = self.speed or (measure_speed(self.cache.dir, stage.weights, stage.device, dtype=stage.dtype)
                                        if self.opts.measure else None)   # a re-cut's START does not measure again
            proc = self.start_stage(stage_id, topology_path, run_dir)
        speed = self.speed
        self.send("STARTED", {"stage": stage_id, "pid": proc.pid, "fetched_bytes": self.fetched_bytes,
                              **({"speed": speed} if speed else {})})
        return proc

    def run_dir(self, stage_id: str) -> Path:
        run_dir = self.opts.cache / "runs" / re.sub(r"[^A-Za-z0-9_.-]", "_", stage_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir

    def prepare(self, msg: link.Message, stage_id: str) -> None:
        """PREPARE: fetch what the next stage lacks; when the driver sent its placed topology, start
        it held (cluster/next_stage.py): PREPARED once it is built (`check_prepared`), else now."""
        self.next_cache, self.next_stage = self.fetch(msg), stage_id
        if self.next_proc is not None:
            self.next_proc.cancel()
            self.next_proc = None
        if "topology" not in msg.header:
            self.send("PREPARED", {"stage": stage_id, "fetched_bytes": self.fetched_bytes})
            return
        run_dir = self.run_dir(f"next-{stage_id}")   # beside the serving stage's run folder, never over it
        prepared = run_dir / "prepared"
        prepared.unlink(missing_ok=True)
        proc = self.start_stage(stage_id, self.stage_topology(msg, self.next_cache, run_dir), run_dir, prepared)
        self.next_proc = NextStage(stage_id, proc, prepared)

    def check_prepared(self) -> None:
        """The held next stage is built (PREPARED), or died (PREPARED all the same: START runs it anew)."""
        held = self.next_proc
        if held is None or held is self.announced:
            return
        if held.ready() or held.failed():
            if held.failed():
                logger.error("worker {}: prepared stage {} exited with code {}; it will start at the switch",
                             self.name, held.stage_id, held.proc.returncode)
                self.next_proc = None
            self.announced = held
            self.send("PREPARED", {"stage": held.stage_id, "fetched_bytes": self.fetched_bytes,
                                   "held": not held.failed()})

    def serve(self, proc: subprocess.Popen | None) -> int:
        """Until stopped (SIGTERM / SIGINT) or the stage exits: heartbeats to the driver, and a
        re-cut's steps (PREPARE: fetch the next stage's items while this one serves; HALT: stop the
        stage; START: run the next one)."""
        next_beat = 0.0
        while not self.stop.is_set():
            if proc is not None and proc.poll() is not None:
                logger.error("worker {}: stage {} exited with code {}; see {}", self.name, self.stage_id,
                             proc.returncode, self.opts.cache / "runs" / str(self.stage_id) / f"{self.stage_id}.log")
                return 1
            if time.monotonic() >= next_beat:
                self.send("BEAT", {"stage": self.stage_id if proc is not None else None})
                next_beat = time.monotonic() + BEAT_S
            msg = self.pending_start or self.recv(0.2)
            self.pending_start = None
            if msg is not None:
                proc = self.on_recut(msg, proc)
            self.check_prepared()
        self.halt(proc)
        if self.next_proc is not None:
            self.next_proc.cancel()
        return 0

    def on_recut(self, msg: link.Message, proc: subprocess.Popen | None) -> subprocess.Popen | None:
        if msg.kind == "PREPARE":
            stage_id = link.field(msg, "stage", str)
            logger.info("worker {}: re-cut: fetching what stage {} (layers {}) needs while serving", self.name,
                        stage_id, msg.header.get("layers"))
            self.prepare(msg, stage_id)
        elif msg.kind == "HALT":
            self.halt(proc)
            proc = None
            if msg.header.get("next"):
                self.cache, self.stage_id = self.next_cache, self.next_stage
            else:
                self.stage_id = None
                if self.next_proc is not None:
                    self.next_proc.cancel()
                    self.next_proc = None
            self.send("HALTED", {"stage": msg.header.get("stage")})
        elif msg.kind == "START" and proc is None:
            proc = self.start(msg)
        else:
            logger.warning("worker {}: ignored a {} from the driver", self.name, msg.kind)
        return proc

    def halt(self, proc: subprocess.Popen | None) -> None:
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S + 2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_worker(options: WorkerOptions) -> int:
    """The `worker` command: join, fetch, run the stage; 0 when stopped, 1 on a failure, 3 when refused."""
    options.cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    worker = Worker(options)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop.set())
    try:
        return worker.run()
    except Refused as exc:
        logger.error("worker {}: {}", worker.name, exc)
        return 3
    except (TimeoutError, CacheError, link.LinkError, TopologyError, ValueError, OSError) as exc:
        logger.error("worker {}: {}", worker.name, exc)
        return 1
    except InterruptedError:
        return 0
    finally:
        worker.close()
