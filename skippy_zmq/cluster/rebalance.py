"""Re-cut while serving: move layer ranges between workers without failing a request.

The driver's Rebalancer (one thread) re-plans the split with ops/speed.plan_split from the workers'
measurements when asked (`skippy-zmq rebalance`, a REBALANCE on the cluster link), when a worker
is gone for good (silent for `cluster.gone_after_s`), when a measured worker joins and stands by,
or when a stage's measured step times drift from the plan (cluster/drift.py). Then, in order:

1. PREPARE: each worker of the new split fetches the items of its next stage that it lacks,
   while the old split goes on serving (PREPARED when it has them all);
2. the engine pauses admission and drops in-flight rows (engine/recut.py);
3. HALT: every worker stops its stage (HALTED), so that no port is held twice, but a stage that
   runs on as it is (same worker, layers and next hop): it keeps its process, KV and compiled steps;
4. the engine takes the new split's stage table, then START: the new split's stages (same ids and
   ports, new layer ranges, maybe fewer of them); the engine resumes every paused session from its
   token history once they are READY;
5. the rebalancer waits until the new split is ready and done compiling: that is the re-cut's
   measured cost, which the next drift re-cut must pay back (cluster/payback.py), else it is skipped.

When no split of the workers left fits their memory, the engine answers every request with a 503
that names the missing layers and the worker that had them, until a worker joins.
It never talks to the engine's module (cluster sits below engine): it gets a RecutTarget.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Collection, Protocol

from loguru import logger

from skippy_zmq.checkpoint.manifest import item_files, stage_item_names
from skippy_zmq.cluster import link
from skippy_zmq.cluster.server import ClusterServer, WorkerRecord
from skippy_zmq.cluster.split import MeasuredSplit, log_plan, plan_measured
from skippy_zmq.config.topology import Topology
from skippy_zmq.config.topology_yaml import parse_topology
from skippy_zmq.protocol.keystore import keys_dir_of

PREPARE_TIMEOUT_S = 900.0   # fetching a stage's items while serving (large models on slow links)
HALT_TIMEOUT_S = 60.0       # a stage stops within its grace period
CHECK_S = 0.5               # how often triggers are looked at


class RecutTarget(Protocol):
    """The engine's side (engine/recut.EngineRecut)."""

    def begin(self, reason: str, kept: Collection[str] = ()) -> None: ...
    def finish(self, topology: Topology, kept: Collection[str] = ()) -> None: ...
    def set_missing(self, text: str | None) -> None: ...
    def settle(self, timeout: float) -> bool: ...


@dataclasses.dataclass
class Recut:
    reason: str
    done: Callable[[dict[str, Any]], None] | None = None   # told the outcome (a REBALANCE's reply)
    drift: bool = False                                     # on drift: damped (cluster/payback.py)


def speed_of(record: WorkerRecord) -> dict[str, Any] | None:
    """A worker's measurement: from its MEASURE (split: measured, or a joiner) or its STARTED."""
    return record.measured or (record.started or {}).get("speed")


def trimmed(base: Topology, n: int) -> Topology:
    """`base` with its first n stages only, layers evenly cut (the planner rewrites them)."""
    data = base.to_dict()
    if base.keys_dir is None:   # the generated key folder is named by the stages: keep the base's keys
        data["keys_dir"] = str(keys_dir_of(base))
    layers = base.stages[-1].end
    data["stages"] = data["stages"][:n]
    for i, row in enumerate(data["stages"]):
        row["layers"] = [i * layers // n, (i + 1) * layers // n]
    return parse_topology(data, source=f"{base.source} ({n} stages)")


def layers_text(topology: Topology, stage_id: str | None) -> str:
    if stage_id is None:
        return "no layers"
    stage = topology.stage(stage_id)
    return f"layers [{stage.start}, {stage.end})"


class Rebalancer:
    """Re-cuts the split of a ClusterServer's workers while `target` serves; `close()` when done."""

    def __init__(self, server: ClusterServer, target: RecutTarget, drift: Any = None):
        self.server, self.target, self.drift = server, target, drift
        self.config = server.config
        self.base = server.topology                     # every stage id and port a split may use
        self.requests: queue.Queue[Recut] = queue.Queue()
        self.gone: dict[str, str] = {}                  # worker -> what it held ("stage s1, layers [2, 4)")
        self.considered: set[str] = {w.name for w in server.workers.values() if speed_of(w)}
        self.prepared: dict[str, str] = {}
        self.halted: set[str] = set()
        self.missing: str | None = None
        self.history: list[dict[str, Any]] = []         # one entry per re-cut done: reason, seconds, stages
        self.skipped: list[dict[str, Any]] = []         # drift re-cuts that would not have paid back
        self.cost_s: float | None = None                # the last re-cut's measured cost (begin to settled)
        server.handlers.update(PREPARED=self._on_prepared, HALTED=self._on_halted, REBALANCE=self._on_rebalance)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cluster-rebalance", daemon=True)
        self.thread.start()

    def request(self, reason: str, done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.requests.put(Recut(reason, done))

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)

    # ---------------------------------------------------------------- the server thread's handlers

    def _on_prepared(self, identity: bytes, msg: link.Message, address: str) -> None:
        self.prepared[self.server.by_identity.get(identity, "?")] = str(msg.header.get("stage"))

    def _on_halted(self, identity: bytes, msg: link.Message, address: str) -> None:
        self.halted.add(self.server.by_identity.get(identity, "?"))

    def _on_rebalance(self, identity: bytes, msg: link.Message, address: str) -> None:
        def reply(outcome: dict[str, Any]) -> None:
            self.server.post(lambda: self.server._send(identity, link.Message("REBALANCED", outcome)))
        logger.info("cluster: a re-cut was asked for from {}", address)
        self.request("asked for (`skippy-zmq rebalance`)", reply)

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job: Recut | None = self.requests.get(timeout=CHECK_S)
            except queue.Empty:
                job = self._trigger()
            if job is None:
                continue
            try:
                outcome = self.recut(job.reason, damped=job.drift)
            except Exception as exc:   # a failed re-cut is said; the next trigger tries again
                logger.exception("cluster: the re-cut ({}) failed", job.reason)
                outcome = {"ok": False, "reason": f"the re-cut failed: {exc!r}"[:500]}
            if job.done is not None:
                job.done(outcome)

    def _trigger(self) -> Recut | None:
        """A worker gone for good, a measured worker standing by, or drift (in that order)."""
        now = time.monotonic()
        workers = list(self.server.workers.values())
        for w in workers:
            silent = now - w.last_seen
            if w.name in self.gone and silent < self.config.gone_after_s:
                del self.gone[w.name]                   # it came back: a joiner below
                self.considered.discard(w.name)
            elif w.name not in self.gone and w.stage is not None and w.started is not None \
                    and silent > self.config.gone_after_s:
                self.gone[w.name] = f"stage {w.stage}, {layers_text(self.server.topology, w.stage)}"
                return Recut(f"worker {w.name} ({self.gone[w.name]}) is gone: silent for {silent:.0f} s")
        joiners = [w.name for w in workers if w.stage is None and w.name not in self.gone and speed_of(w)
                   and w.name not in self.considered]
        if joiners:
            return Recut(f"worker(s) {', '.join(joiners)} joined")
        reason = self.drift.check(now) if self.drift is not None else None
        return Recut(reason, drift=True) if reason else None

    # ---------------------------------------------------------------- one re-cut

    def recut(self, reason: str, damped: bool = False) -> dict[str, Any]:
        """Plan, prepare while serving, pause, halt, start the new split, wait until it settled; the
        outcome as JSON. `damped`: only when the new split pays back the last re-cut's cost."""
        logger.info("cluster: re-cut ({})", reason)
        measured: dict[str, dict[str, Any]] = {}
        split = self._plan(measured)
        if split is None:
            return {"ok": False, "reason": self.missing or "no split fits the workers' memory (see the driver's log)"}
        if self._current() == self._stages(split.topology, split.workers) and self.missing is None:
            logger.info("cluster: re-cut ({}): the split stays as it is", reason)
            return {"ok": True, "changed": False, "stages": self._current()}
        payback = self._payback(split, measured) if damped else None
        if payback is not None and not payback.worth_it:
            logger.info("cluster: re-cut ({}) skipped: {}", reason, payback.text())
            self.skipped.append({"reason": reason, "why": payback.text()})
            return {"ok": True, "changed": False, "skipped": payback.text(), "stages": self._current()}
        return self.switch(split, reason)

    def switch(self, split: MeasuredSplit, reason: str) -> dict[str, Any]:
        """Move to `split` (module docstring, steps 1-5); a stage that runs on as it is (`_kept`) is
        neither prepared, halted nor started: its process, KV and compiled steps stay."""
        placed = self._placed(split)
        kept = self._kept(split, placed)
        t0 = time.monotonic()
        if not self._prepare(split, kept, placed):
            return {"ok": False, "reason": "a worker of the new split did not fetch its items in time; split kept"}
        fetched = time.monotonic() - t0
        self.target.begin(reason, kept)
        if self.missing is not None:
            self.missing = None
            self.target.set_missing(None)
        self._halt(split, kept)
        # the engine takes the new split's stage table before any new stage can say READY: a READY that
        # landed in the old table (a held stage opens its ports at once) was lost with it, and that stage
        # never counted as ready, or an old table all ready resumed on the old split
        self.target.finish(placed, kept)
        self._install(split, kept)
        self.gone = dict.fromkeys(self.gone, "")        # planned around: they hold nothing of this split
        if self.drift is not None:
            self.drift.reset(self.server.topology, {w.name: w for w in self.server.workers.values()})
        done = {"ok": True, "changed": True, "reason": reason, "stages": self._current(), "kept": sorted(kept),
                "prepare_s": round(fetched, 3), "switch_s": round(time.monotonic() - t0 - fetched, 3),
                "predicted_ms_per_token": round(split.prediction.ms_per_token_1, 3)}
        logger.info("cluster: re-cut ({}) done: {}; the engine resumes once the stages are READY", reason,
                    ", ".join(f"{s[0]} [{s[1]}, {s[2]}) on {s[3]}" for s in done["stages"]))
        self.history.append(done)   # (a bench times the switch from here; cost_s is added below)
        settled = self.target.settle(self.base.driver.resume_timeout_s)
        self.cost_s = done["cost_s"] = round(time.monotonic() - t0 - fetched, 3)
        logger.info("cluster: re-cut ({}) {} {:.1f} s after the pause began", reason,
                    "settled (every stage ready, done compiling)" if settled else "not settled", self.cost_s)
        return done

    def _payback(self, split: MeasuredSplit, measured: dict[str, dict[str, Any]]):   # -> payback.Payback | None
        """Whether `split` pays back the last re-cut's cost, at the speeds it was planned with."""
        from skippy_zmq.cluster.payback import Payback, current_ms, planned_ms

        now = current_ms(self.server.topology, [s[3] for s in self._current()], measured,
                         self.config.objective, self.config.streams)
        if now is None:
            return None
        return Payback(now, planned_ms(split.prediction, self.config.objective), self.cost_s,
                       self.config.recut_payback_s)

    def _placed(self, split: MeasuredSplit) -> Topology:
        """`split` placed on its workers' addresses (what _install will place)."""
        from skippy_zmq.cluster.assign import placed_topology

        return placed_topology(split.topology, {st.id: self.server.workers[name].address
                                                for st, name in zip(split.topology.stages, split.workers)})

    def _kept(self, split: MeasuredSplit, new: Topology) -> frozenset[str]:
        """The stages of `split` that run on as they are: the same worker, the same stage settings
        (layers, endpoints), and the stage after it reached at the same endpoint (a stage keeps the
        topology it started with: it would push to an old address). None while the model is broken."""
        old = self.server.placed
        if old is None or self.missing is not None or any(self.gone.values()):
            return frozenset()
        holder = {w.stage: w.name for w in self.server.workers.values() if w.stage is not None}
        old_ids = [st.id for st in old.stages]

        def after(topology: Topology, i: int) -> str | None:
            return topology.stages[i + 1].connect if i + 1 < len(topology.stages) else None
        return frozenset(st.id for i, (st, name) in enumerate(zip(new.stages, split.workers))
                         if holder.get(st.id) == name and st.id in old_ids and old.stage(st.id) == st
                         and old_ids.index(st.id) == i and after(old, i) == after(new, i))

    @staticmethod
    def _stages(topology: Topology, workers: tuple[str, ...]) -> list[list[Any]]:
        return [[s.id, s.start, s.end, w] for s, w in zip(topology.stages, workers)]

    def _current(self) -> list[list[Any]]:
        by_stage = {w.stage: w.name for w in self.server.workers.values() if w.stage is not None}
        return [[s.id, s.start, s.end, by_stage.get(s.id)] for s in self.server.topology.stages]

    def _plan(self, measured: dict[str, dict[str, Any]]) -> MeasuredSplit | None:
        """The best split of the live measured workers (as many stages as there are, up to the
        topology's); None (and the engine's 503 when the model is broken) when none fits. `measured`
        is filled with the speeds it planned with (name -> measure_host dict, drift-scaled)."""
        from skippy_zmq.ops.speed import SpeedPlanError

        workers = [w for w in list(self.server.workers.values()) if w.name not in self.gone and speed_of(w)]
        self.considered = {w.name for w in workers}
        if self.drift is not None:   # whatever asked for it, plan at the speeds the replies show now
            logger.info("cluster: re-cut plans with each worker's measurement scaled by {}", self.drift.refresh())
        n = min(len(self.base.stages), len(workers))
        measured.update({w.name: self._speed(w) for w in workers})
        try:
            if n == 0:
                raise SpeedPlanError("no worker with a measurement is left")
            base = self.base if n == len(self.base.stages) else trimmed(self.base, n)
            split = plan_measured(base, measured, self.config.objective, self.config.streams)
        except SpeedPlanError as exc:
            self._no_split(exc, measured)
            return None
        log_plan(split, self.config.objective)
        return split

    def _speed(self, record: WorkerRecord) -> dict[str, Any]:
        speed = speed_of(record) or {}
        return self.drift.scaled(record.name, speed) if self.drift is not None else speed

    def _no_split(self, exc: Exception, measured: dict[str, dict[str, Any]]) -> None:
        if not any(self.gone.values()):   # nothing of the split in use is lost: it stays
            logger.error("cluster: no re-cut: {}; the split stays as it is", exc)
            return
        left = ", ".join(f"{name} ({float(m.get('memory_available') or 0) / (1 << 20):.1f} MiB available)"
                         for name, m in measured.items()) or "none"
        lost = "; ".join(f"{held} (worker {name}, gone)" for name, held in self.gone.items() if held) or "a stage"
        self.missing = (f"the model is not whole: {lost} missing, and the workers left ({left}) cannot hold "
                        f"all {self.base.stages[-1].end} layers ({exc}); add a worker with "
                        f"`skippy-zmq worker --join TOKEN`")
        logger.error("cluster: {}", self.missing)
        self.target.set_missing(self.missing)

    def _prepare(self, split: MeasuredSplit, kept: frozenset[str], placed: Topology) -> bool:
        """Each worker of the new split fetches what its next stage lacks and starts it held (restored
        and compiled, no port open: cluster/next_stage.py) while the old one serves."""
        from skippy_zmq.cluster.assign import stage_key_files

        s = self.server
        wanted = {name: stage for name, stage in zip(split.workers, split.topology.stages) if stage.id not in kept}
        self.prepared.clear()

        def send() -> None:
            for name, stage in wanted.items():
                record = s.workers[name]
                record.next_files = item_files(s.manifest, stage_item_names(s.model_cfg, stage.start, stage.end))
                s._send(record.identity, link.Message("PREPARE", {
                    "stage": stage.id, "layers": [stage.start, stage.end], "digest": s.digest,
                    "files": record.next_files, "max_chunk_bytes": s.config.max_chunk_bytes,
                    "topology": placed.to_dict(), "keys": stage_key_files(placed, stage.id)}))
        s.post(send)

        def settled() -> bool:
            now = time.monotonic()
            return all(self.prepared.get(n) == st.id for n, st in wanted.items()) or any(
                now - s.workers[n].last_seen > self.config.gone_after_s for n in wanted)
        s.wait_until(settled, PREPARE_TIMEOUT_S)
        return all(self.prepared.get(n) == st.id for n, st in wanted.items())

    def _halt(self, split: MeasuredSplit, kept: frozenset[str]) -> None:
        """Every live worker that runs a stage or gets one stops its stage (so no port is held twice),
        but those whose stage is `kept`."""
        s = self.server
        planned = set(split.workers)
        halting = [w for w in list(s.workers.values()) if w.name not in self.gone and w.stage not in kept
                   and (w.stage is not None or w.name in planned)]
        self.halted.clear()

        def send() -> None:
            for w in halting:
                s._send(w.identity, link.Message("HALT", {"stage": w.stage, "next": w.name in planned}))
        s.post(send)
        if not s.wait_until(lambda: all(w.name in self.halted for w in halting), HALT_TIMEOUT_S):
            logger.warning("cluster: re-cut: {} did not say HALTED in {:g} s; going on", ", ".join(
                w.name for w in halting if w.name not in self.halted), HALT_TIMEOUT_S)

    def _install(self, split: MeasuredSplit, kept: frozenset[str]) -> None:
        """The new split becomes the server's: stages given, placed, and each worker told to START
        (but those whose stage is `kept`)."""
        s = self.server
        installed = threading.Event()

        def install() -> None:
            try:
                s.topology = split.topology
                s.stage_files = s._stage_files(split.topology)
                for w in s.workers.values():
                    w.stage, w.next_files = None, None
                for stage, name in zip(split.topology.stages, split.workers):
                    s.workers[name].stage = stage.id
                s._place(kept)
            finally:
                installed.set()
        s.post(install)
        if not installed.wait(HALT_TIMEOUT_S):
            raise TimeoutError("the cluster server did not install the new split")
