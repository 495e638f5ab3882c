"""The engine's side of a re-cut (cluster/rebalance.py decides when and where to): pause
admission, drop what is in flight, wait for the stages of the new split, resume.

It rides on the resume path a stage failure already uses (Scheduler.pause / resume): in-flight
rows are dropped and every running session is re-prefilled from its token history once every
stage of the new split said READY, so greedy output is what it would have been without the
re-cut. Requests that arrive meanwhile queue (`engine.recutting` lets `submit` take them).

A stage of the old split must not count as one of the new: every stage that moves is marked not
ready with no known incarnation, so only a READY (a new process) makes it ready again; the fence
(protocol/fencing.py) drops whatever the old processes left in the pipes. A stage the re-cut leaves
as it is (`kept`: same worker, layers and next hop) stays ready with its process, KV and compiled
steps, as the stages beside a failed one do; the re-prefill rewrites its lanes at the same positions.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Collection

from loguru import logger

from skippy_zmq.config.topology import Topology
from skippy_zmq.engine.pipeline import PipelineEngine, StageState
from skippy_zmq.engine.prefix_index import PrefixIndex
from skippy_zmq.engine.request import EngineError

STEP_TIMEOUT_S = 10.0   # the pipeline thread answers a command within one pass of its loop
SETTLE_CHECK_S = 0.5    # how often `settle` looks at the stages' compile state


class EngineRecut:
    """What cluster/rebalance.Rebalancer asks of the pipeline engine (each runs on its thread)."""

    def __init__(self, engine: PipelineEngine):
        self.engine = engine

    def _on_loop(self, fn) -> None:
        done = threading.Event()
        failed: list[BaseException] = []

        def step() -> None:
            try:
                fn()
            except BaseException as exc:   # said to the caller, not only to the loop's log
                failed.append(exc)
                raise
            finally:
                done.set()
        self.engine.call(step)
        if not done.wait(STEP_TIMEOUT_S):
            raise TimeoutError("the pipeline thread did not answer a re-cut step")
        if failed:
            raise failed[0]

    def begin(self, reason: str, kept: Collection[str] = ()) -> None:
        """Pause admission and drop in-flight rows; no stage counts as ready until it says READY again,
        but the `kept` ones: they run on as they are (same process, layers, KV and compiled steps),
        as the stages beside a failed one do on the resume path."""
        def step() -> None:
            e = self.engine
            e.recutting = True
            e.scheduler.pause(f"re-cut: {reason}")
            for state in e.stages.values():
                if state.stage_id not in kept:
                    state.ready, state.incarnation = False, 0
            e._ready.clear()
            logger.info("re-cut ({}): paused {} request(s); they resume from their token history on the new "
                        "split", reason, len(e.scheduler.running))
        self._on_loop(step)

    def finish(self, topology: Topology, kept: Collection[str] = ()) -> None:
        """The new split's topology (same stage ids, new layer ranges; maybe fewer stages): the engine
        waits for its new stages' READY (the `kept` ones stay as they are), then resumes
        (PipelineEngine._update_ready)."""
        def step() -> None:
            e = self.engine
            old_first = e.topology.first.connect
            e.topology = topology
            e.stages = {s.id: e.stages[s.id] if s.id in kept and s.id in e.stages else StageState(s.id)
                        for s in topology.stages}
            e.scheduler.cfg = dataclasses.replace(e.scheduler.cfg, n_stages=len(topology.stages))
            index = PrefixIndex([s.cache for s in topology.stages])   # the new stages' stores start empty
            e.scheduler.state.index = index if index.enabled else None
            if topology.first.connect != old_first and e.socks is not None:
                e.socks.push.disconnect(old_first)
                e.socks.push.connect(topology.first.connect)
        self._on_loop(step)

    def set_missing(self, text: str | None) -> None:
        """No split of the workers left holds the model (`text` says what is missing): every request,
        running or new, gets a 503 with it; None: the model is whole again."""
        def step() -> None:
            e = self.engine
            e.missing = text
            if text is not None:
                e.recutting = False
                e.scheduler.fail_all(EngineError(text, 503, "layers_missing"))
        self._on_loop(step)

    def wait_ready(self, timeout: float) -> bool:
        return self.engine.wait_ready(timeout)

    def settle(self, timeout: float) -> bool:
        """Wait until every stage of the new split is ready and done compiling behind serving (its
        heartbeats say `compiling`), up to `timeout`; False when it was not by then. Where a re-cut's
        measured cost ends (cluster/payback.py). Looked at every SETTLE_CHECK_S, a heartbeat's pace."""
        deadline = time.monotonic() + timeout
        if not self.engine.wait_ready(timeout):
            return False
        pause = threading.Event()
        while True:
            compiling: list[str] = []
            self._on_loop(lambda: compiling.extend(
                sid for sid, state in self.engine.stages.items() if state.info.get("compiling", True)))
            if not compiling:
                return True
            if time.monotonic() > deadline:
                return False
            pause.wait(SETTLE_CHECK_S)


def attach_rebalancer(server, engine: PipelineEngine):   # (ClusterServer) -> Rebalancer
    """Re-cut `server`'s split while `engine` serves (the driver's `cluster.recut: true`)."""
    from skippy_zmq.cluster.drift import DriftMonitor
    from skippy_zmq.cluster.rebalance import Rebalancer

    drift = DriftMonitor(server.config.recut_threshold, server.config.recut_window_s)
    drift.reset(server.topology, dict(server.workers))
    def observe(stage_id: str, msg) -> None:   # on the pipeline thread, which owns engine.stages
        # a stage whose shapes still compile behind serving (heartbeats say so) runs slower for now
        warming = [sid for sid, state in engine.stages.items() if state.info.get("compiling", True)]
        drift.observe(msg.extras.get("trace"), warming)
    engine.on_reply_hooks.append(observe)
    return Rebalancer(server, EngineRecut(engine), drift)
