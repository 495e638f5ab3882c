"""TRY_RESTORE_PREFILL and TRY_RESTORE_PREFILL_DECODE at one stage.

The route is decided by the pure tables in stage/routing.py; this module
carries them out against the worker's runner, sessions and prefix store:

    DirectMiss  -> ACK(miss) straight to the driver, forward nothing
    ForwardHit  -> restore, (run current,) forward down the chain, reply nothing
    DirectHit   -> restore, (run current, sample, record,) reply to the driver
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
from loguru import logger

from skippy_zmq.stage.routing import Route, check_restore_tokens, decide_restore_route, decide_route
from skippy_zmq.stage.types import DRIVER, NEXT, Outbound, StageFault
from skippy_zmq.wire import Kind, Message

if TYPE_CHECKING:
    from skippy_zmq.stage.worker import StageWorker

DEFAULT_NAMESPACE = "default"


class RestoreRoutes:
    def __init__(self, worker: "StageWorker"):
        self.worker = worker

    # ------------------------------------------------------------ helpers

    def _lookup(self, namespace: str, prefix: np.ndarray) -> Any:
        store = self.worker.store
        if store is None or not store.config.mode == "lookup-record":
            return None
        return store.lookup(namespace, prefix)

    def _restore(self, msg: Message, entry: Any, prefix: np.ndarray) -> Any:
        """Put the entry's KV into the session's lane at positions [0, length)."""
        w = self.worker
        session = w._acquire(msg.session_id, msg.request_id)
        w.lock.run(lambda: w.runner.write_kv(session.lane, entry.k, entry.v))
        session.reset([int(t) for t in prefix[:entry.length]])
        return session

    def _event(self, route: Route, msg: Message, matched: int, t0: float, compute_ms: float = 0.0,
               forwarded: Message | None = None) -> dict[str, Any]:
        """One telemetry event per route (also returned as the ACK's stats)."""
        w = self.worker
        stats = {"stage": w.info.stage_id, "route": route.name.lower(),
                 "status": "miss" if route == Route.DIRECT_MISS else "hit", "matched": matched,
                 "elapsed_ms": round(1000 * (time.perf_counter() - t0), 3), "compute_ms": round(compute_ms, 3),
                 "lock_wait_ms": round(w.lock.wait_ms, 3), "lock_hold_ms": round(w.lock.hold_ms, 3),
                 "evictions": w.store.stats()["evictions"] if w.store else 0}
        if forwarded is not None and forwarded.activation is not None:
            stats["forwarded_bytes"] = int(forwarded.activation.nbytes)
        logger.info("restore {} {} at stage {}: matched {} tokens in {:.2f} ms (session {})", route.name,
                    stats["status"], w.info.stage_id, matched, stats["elapsed_ms"], msg.session_id)
        return stats

    def _ack(self, msg: Message, stats: dict[str, Any]) -> Outbound:
        return Outbound(DRIVER, Message.ack(msg.request_id, msg.session_id, {"restore": stats}))

    @staticmethod
    def _namespace(msg: Message) -> str:
        return str(msg.extras.get("namespace") or DEFAULT_NAMESPACE)

    # ------------------------------------------------------------ handlers

    def on_try_restore_prefill(self, msg: Message) -> list[Outbound]:
        t0 = time.perf_counter()
        prefix = msg.tokens
        if prefix.shape[0] == 0:
            raise StageFault("TRY_RESTORE_PREFILL needs at least one prefix token", "bad_restore")
        entry = self._lookup(self._namespace(msg), prefix)
        route = decide_restore_route(entry is not None, not self.worker.info.last)
        if route == Route.DIRECT_MISS:
            return [self._ack(msg, self._event(route, msg, 0, t0))]
        self._restore(msg, entry, prefix)
        stats = self._event(route, msg, entry.length, t0)
        return [Outbound(NEXT, msg)] if route == Route.FORWARD_HIT else [self._ack(msg, stats)]

    def on_try_restore_prefill_decode(self, msg: Message) -> list[Outbound]:
        t0 = time.perf_counter()
        try:
            check_restore_tokens(int(msg.tokens.shape[0]))
        except ValueError as exc:
            raise StageFault(str(exc), "bad_restore") from exc
        w = self.worker
        prefix, current = msg.tokens[:-1], int(msg.tokens[-1])
        namespace = self._namespace(msg)
        entry = self._lookup(namespace, prefix)
        route = decide_route(entry is not None, not w.info.last)
        if route == Route.DIRECT_MISS:
            return [self._ack(msg, self._event(route, msg, 0, t0))]
        session = self._restore(msg, entry, prefix)
        if w.info.last:   # a fused restore configures the final stage, as CONFIGURE_GENERATION does
            session.set_sampler(w.make_sampler(msg.extras, msg.tokens.tolist()))
        # `current` runs as an ordinary one-token DECODE at its absolute position.
        position = entry.length
        decode = Message(Kind.DECODE, msg.request_id, msg.session_id, position=position,
                         tokens=np.array([current], np.int32), positions=np.array([position], np.int32),
                         activation=msg.activation, extras=msg.extras)
        t1 = time.perf_counter()
        outs = w.on_decode(decode)
        compute_ms = 1000 * (time.perf_counter() - t1)
        if route == Route.FORWARD_HIT:
            outs = [replace(o, message=replace(o.message, kind=Kind.TRY_RESTORE_PREFILL_DECODE, tokens=msg.tokens,
                                               positions=None, sessions=None, position=0))
                    if o.to == NEXT else o for o in outs]
            forwarded = next((o.message for o in outs if o.to == NEXT), None)
            self._event(route, msg, entry.length, t0, compute_ms, forwarded)
            return outs
        stats = self._event(route, msg, entry.length, t0, compute_ms)
        w.deferred.append(lambda: w.record(session, namespace))   # DirectHit records after answering
        return [replace(o, message=replace(o.message, extras={**o.message.extras, "restore": stats}))
                if o.message.kind == Kind.PREDICTED_TOKENS else o for o in outs]
