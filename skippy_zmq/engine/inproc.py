"""In-process twin of the transport: a chain of StageWorkers joined by wire
encode/decode (so activation dtypes and validation apply) but no sockets.

The Scheduler runs over it synchronously, exactly as over the socket pipeline:
single-process generation (engine/generate.py's LocalEngine) is the Scheduler
over a chain of one stage holding every layer; tests chain several.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from skippy_zmq.protocol import wire
from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent
from skippy_zmq.engine.scheduler import Scheduler
from skippy_zmq.stage.worker import DRIVER, OWN, RING, StageWorker


@dataclass
class HopStats:
    messages: int = 0
    activation_bytes: int = 0
    tokens: int = 0


@dataclass
class InprocChain:
    workers: list[StageWorker]
    dtype: wire.WireDType = wire.WireDType.F32
    limits: wire.WireLimits = field(default_factory=wire.WireLimits)
    hops: list[HopStats] = field(default_factory=list)
    busy_s: dict[wire.Kind, float] = field(default_factory=lambda: defaultdict(float))   # per kind sent

    def __post_init__(self) -> None:
        self.hops = [HopStats() for _ in self.workers[1:]]

    def send(self, msg: wire.Message) -> list[tuple[str, wire.Message]]:
        """Deliver one message to stage 0 and run it down the chain; returns (stage_id, reply) pairs."""
        t0 = time.perf_counter()
        replies = self._run(msg)
        self.busy_s[msg.kind] += time.perf_counter() - t0
        return replies

    def _run(self, msg: wire.Message) -> list[tuple[str, wire.Message]]:
        replies: list[tuple[str, wire.Message]] = []
        pending: deque[tuple[int, wire.Message, bool]] = deque([(0, self._through_wire(msg, wire.WireDType.F32),
                                                                 False)])
        while pending:   # (stage index, message, a step run on: a stage's own or the ring's)
            index, message, own = pending.popleft()
            worker = self.workers[index]
            outs = worker.handle_own(message) if own else worker.handle(message)
            worker.run_deferred()
            if worker.store is not None:
                worker.store.flush()   # records land before the next message, deterministically
            for out in outs:
                if out.to == DRIVER:
                    replies.append((worker.info.stage_id, self._through_wire(out.message, wire.WireDType.F32)))
                elif out.to == OWN:
                    pending.append((index, out.message, True))
                elif out.to == RING:   # the last stage's step, round to the first (stage/run_on.py)
                    pending.append((0, self._through_wire(out.message, wire.WireDType.F32), True))
                else:
                    frames = wire.encode(out.message, self.dtype)
                    hop = self.hops[index]
                    hop.messages += 1
                    if out.message.activation is not None:
                        hop.activation_bytes += len(frames[4])
                        hop.tokens += int(out.message.activation.shape[0])
                    pending.append((index + 1, wire.decode(frames, self.limits), False))
        return replies

    def _through_wire(self, msg: wire.Message, dtype: wire.WireDType) -> wire.Message:
        return wire.decode([bytes(f) for f in wire.encode(msg, dtype)], self.limits)


def finished(events: list[Any]) -> bool:
    """A request's events end with an error or with a token event that has a finish reason."""
    return bool(events) and (isinstance(events[-1], EngineError) or
                             (isinstance(events[-1], TokenEvent) and events[-1].finish_reason is not None))


def run_until(scheduler: Scheduler, chain: InprocChain, done: Callable[[], bool],
              max_iterations: int = 100_000) -> None:
    """The engine loop without sockets: tick, deliver each message down the chain, hand every reply
    back, until `done()` and nothing runs; then once more, so the STOPs that finishing queued
    reach the stages and free their lanes."""
    def step() -> None:
        for msg in scheduler.tick():
            for stage_id, reply in chain.send(msg):
                scheduler.on_reply(stage_id, reply)

    for _ in range(max_iterations):
        if done() and not scheduler.running:
            step()
            return
        step()
    raise RuntimeError("requests did not finish")


def run_requests(scheduler: Scheduler, chain: InprocChain, requests: list[GenRequest],
                 max_iterations: int = 100_000) -> dict[str, list[Any]]:
    """Submit all requests, run the loop until every one finished; events per request id."""
    events: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    for req in requests:
        scheduler.submit(req, events[req.request_id].append)
    run_until(scheduler, chain, lambda: all(finished(v) for v in events.values()), max_iterations)
    return events


def tokens_of(items: list[Any]) -> list[int]:
    return [e.token_id for e in items if isinstance(e, TokenEvent) and e.token_id is not None]
