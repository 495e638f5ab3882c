"""TRY_RESTORE_PREFILL and TRY_RESTORE_PREFILL_DECODE at one stage.

The route is decided by the pure tables in stage/routing.py; this module
carries them out through the narrow RestoreHost its stage provides:

    DirectMiss  -> ACK(miss) straight to the driver, forward nothing
    ForwardHit  -> restore, (run current,) forward down the chain, reply nothing
    DirectHit   -> restore, (run current, sample, record,) reply to the driver
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
from loguru import logger

from skippy_zmq.stage.routing import Route, check_restore_tokens, decide_restore_route, decide_route
from skippy_zmq.stage.types import DRIVER, NEXT, Outbound, StageFault, StageInfo
from skippy_zmq.protocol.wire import Kind, Message
from skippy_zmq.kv.prefix_store import DEFAULT_NAMESPACE


class RestoreHost(Protocol):
    """All that restore needs of its stage (StageWorker provides it), and nothing more."""

    info: StageInfo   # stage_id for telemetry; last decides the route

    def lookup_prefix(self, namespace: str, prefix: np.ndarray) -> Any:
        """The prefix store's entry (k, v, length) for the longest stored prefix, or None."""

    def restore_session(self, session_id: int, request_id: int, entry: Any, prefix: np.ndarray) -> Any:
        """The session, acquired, holding the entry's KV and token ids at [0, entry.length)."""

    def make_sampler(self, extras: dict[str, Any], prompt: list[int]) -> Any:
        """The final stage's sampler of a CONFIGURE_GENERATION's extras."""

    def on_decode(self, msg: Message) -> list[Outbound]:
        """Run a DECODE's rows as any other."""

    def record_later(self, session: Any, namespace: str) -> None:
        """Record the session's KV into the prefix store after the replies are sent."""

    def restore_telemetry(self) -> dict[str, Any]:
        """lock_wait_ms, lock_hold_ms and evictions for a route's telemetry event."""


class RestoreRoutes:
    def __init__(self, host: RestoreHost):
        self.host = host

    # ------------------------------------------------------------ helpers

    def _event(self, route: Route, msg: Message, matched: int, t0: float, compute_ms: float = 0.0,
               forwarded: Message | None = None) -> dict[str, Any]:
        """One telemetry event per route (also returned as the ACK's stats)."""
        stage_id = self.host.info.stage_id
        stats = {"stage": stage_id, "route": route.name.lower(),
                 "status": "miss" if route == Route.DIRECT_MISS else "hit", "matched": matched,
                 "elapsed_ms": round(1000 * (time.perf_counter() - t0), 3), "compute_ms": round(compute_ms, 3),
                 **self.host.restore_telemetry()}
        if forwarded is not None and forwarded.activation is not None:
            stats["forwarded_bytes"] = int(forwarded.activation.nbytes)
        logger.info("restore {} {} at stage {}: matched {} tokens in {:.2f} ms (session {})", route.name,
                    stats["status"], stage_id, matched, stats["elapsed_ms"], msg.session_id)
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
        entry = self.host.lookup_prefix(self._namespace(msg), prefix)
        route = decide_restore_route(entry is not None, not self.host.info.last)
        if route == Route.DIRECT_MISS:
            return [self._ack(msg, self._event(route, msg, 0, t0))]
        self.host.restore_session(msg.session_id, msg.request_id, entry, prefix)
        stats = self._event(route, msg, entry.length, t0)
        return [Outbound(NEXT, msg)] if route == Route.FORWARD_HIT else [self._ack(msg, stats)]

    def on_try_restore_prefill_decode(self, msg: Message) -> list[Outbound]:
        t0 = time.perf_counter()
        try:
            check_restore_tokens(int(msg.tokens.shape[0]))
        except ValueError as exc:
            raise StageFault(str(exc), "bad_restore") from exc
        host = self.host
        prefix, current = msg.tokens[:-1], int(msg.tokens[-1])
        namespace = self._namespace(msg)
        entry = host.lookup_prefix(namespace, prefix)
        route = decide_route(entry is not None, not host.info.last)
        if route == Route.DIRECT_MISS:
            return [self._ack(msg, self._event(route, msg, 0, t0))]
        session = host.restore_session(msg.session_id, msg.request_id, entry, prefix)
        if host.info.last:   # a fused restore configures the final stage, as CONFIGURE_GENERATION does
            session.set_sampler(host.make_sampler(msg.extras, msg.tokens.tolist()))
        # `current` runs as an ordinary one-token DECODE at its absolute position.
        position = entry.length
        decode = Message(Kind.DECODE, msg.request_id, msg.session_id, position=position,
                         tokens=np.array([current], np.int32), positions=np.array([position], np.int32),
                         activation=msg.activation, extras=msg.extras)
        t1 = time.perf_counter()
        outs = host.on_decode(decode)
        compute_ms = 1000 * (time.perf_counter() - t1)
        if route == Route.FORWARD_HIT:
            outs = [replace(o, message=replace(o.message, kind=Kind.TRY_RESTORE_PREFILL_DECODE, tokens=msg.tokens,
                                               positions=None, sessions=None, position=0))
                    if o.to == NEXT else o for o in outs]
            forwarded = next((o.message for o in outs if o.to == NEXT), None)
            self._event(route, msg, entry.length, t0, compute_ms, forwarded)
            return outs
        stats = self._event(route, msg, entry.length, t0, compute_ms)
        host.record_later(session, namespace)   # DirectHit records after answering
        return [replace(o, message=replace(o.message, extras={**o.message.extras, "restore": stats}))
                if o.message.kind == Kind.PREDICTED_TOKENS else o for o in outs]
