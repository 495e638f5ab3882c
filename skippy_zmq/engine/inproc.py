"""In-process twin of the transport: a chain of StageWorkers joined by wire
encode/decode (so activation dtypes and validation apply) but no sockets.

Tests and benchmarks drive the real Scheduler through it synchronously.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from skippy_zmq.protocol import wire
from skippy_zmq.engine.request import EngineError, GenRequest, TokenEvent
from skippy_zmq.engine.scheduler import Scheduler
from skippy_zmq.stage.worker import DRIVER, StageWorker


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

    def __post_init__(self) -> None:
        self.hops = [HopStats() for _ in self.workers[1:]]

    def send(self, msg: wire.Message) -> list[tuple[str, wire.Message]]:
        """Deliver one message to stage 0 and run it down the chain; returns (stage_id, reply) pairs."""
        replies: list[tuple[str, wire.Message]] = []
        pending: deque[tuple[int, wire.Message]] = deque([(0, self._through_wire(msg, wire.WireDType.F32))])
        while pending:
            index, message = pending.popleft()
            worker = self.workers[index]
            outs = worker.handle(message)
            worker.run_deferred()
            if worker.store is not None:
                worker.store.flush()   # records land before the next message, deterministically
            for out in outs:
                if out.to == DRIVER:
                    replies.append((worker.info.stage_id, self._through_wire(out.message, wire.WireDType.F32)))
                else:
                    frames = wire.encode(out.message, self.dtype)
                    hop = self.hops[index]
                    hop.messages += 1
                    if out.message.activation is not None:
                        hop.activation_bytes += len(frames[4])
                        hop.tokens += int(out.message.activation.shape[0])
                    pending.append((index + 1, wire.decode(frames, self.limits)))
        return replies

    def _through_wire(self, msg: wire.Message, dtype: wire.WireDType) -> wire.Message:
        return wire.decode([bytes(f) for f in wire.encode(msg, dtype)], self.limits)


def run_requests(scheduler: Scheduler, chain: InprocChain, requests: list[GenRequest],
                 max_iterations: int = 100_000) -> dict[str, list[Any]]:
    """Submit all requests, run the loop until every one finished; events per request id."""
    events: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    for req in requests:
        scheduler.submit(req, events[req.request_id].append)

    def finished(items: list[Any]) -> bool:
        return bool(items) and (isinstance(items[-1], EngineError) or
                                (isinstance(items[-1], TokenEvent) and items[-1].finish_reason is not None))

    def step() -> None:
        for msg in scheduler.tick():
            for stage_id, reply in chain.send(msg):
                scheduler.on_reply(stage_id, reply)

    for _ in range(max_iterations):
        if all(finished(v) for v in events.values()) and not scheduler.running:
            step()   # deliver what finishing queued (STOPs), so stages free their lanes
            return events
        step()
    raise RuntimeError("requests did not finish")


def tokens_of(items: list[Any]) -> list[int]:
    return [e.token_id for e in items if isinstance(e, TokenEvent) and e.token_id is not None]
