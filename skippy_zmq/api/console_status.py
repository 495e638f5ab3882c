"""The console's pipeline view as JSON (GET /v1/console/status), from what the driver already knows.

A pipeline's stages describe themselves in the topology (id, host, device, layer range) and in
their READY / heartbeat extras (StageWorker.status(): weight, KV, prefix-store and RSS bytes
against the placement plan, lanes, token and cache counters). The traces that PREDICTED_TOKENS
replies carry give each stage's step (compute) time and, from the stages' send and receive wall
clocks, the time of each hop. `PipelineTelemetry` is the on-reply hook that keeps the recent ones.

Nothing here is invented: whatever is not known is None (the page shows "—"). An engine with no
stages (anything that is not a PipelineEngine) is shown as one "local" stage.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from skippy_zmq.protocol import wire

if TYPE_CHECKING:   # the pipeline (and zmq) load only where a pipeline is served
    from skippy_zmq.engine.pipeline import PipelineEngine
    from skippy_zmq.api.context import ServerContext

RECENT_TRACES = 64       # decode steps the step and hop medians are taken over
RATE_WINDOW_S = 5.0      # tokens/s: the counter's rise over about the last few seconds
RATE_SAMPLES = 64        # samples a rate keeps (heartbeats every 0.2-0.5 s; status polls every 1 s)


class RateWindow:
    """The rate of a cumulative counter over its samples of the last RATE_WINDOW_S seconds.
    A counter that went down (a replaced stage starts again from 0) restarts the window."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=RATE_SAMPLES)

    def add(self, now: float, value: float) -> None:
        if self._samples and value < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((now, value))

    def rate(self) -> float | None:
        """Per second; None until two samples at least 0.5 s apart fall in the window."""
        if not self._samples:
            return None
        t_last, v_last = self._samples[-1]
        inside = [s for s in self._samples if t_last - s[0] <= RATE_WINDOW_S]
        t_first, v_first = inside[0]
        return (v_last - v_first) / (t_last - t_first) if t_last - t_first >= 0.5 else None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


class PipelineTelemetry:
    """Keeps what replies tell about the chain (on the pipeline thread); `status()` reads it (any thread)."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._traces: deque[tuple[int, list[dict[str, Any]]]] = deque(maxlen=RECENT_TRACES)
        self._token_rates = {s.id: RateWindow() for s in engine.topology.stages}

    def on_reply(self, stage_id: str, msg: wire.Message) -> None:
        """engine.on_reply_hooks: a decode step's trace, with when the driver received it; a heartbeat's
        token counter."""
        if msg.kind == wire.Kind.PREDICTED_TOKENS:
            trace = msg.extras.get("trace")
            if isinstance(trace, list) and trace and all(isinstance(hop, dict) for hop in trace):
                with self._lock:
                    self._traces.append((time.time_ns(), trace))
        elif msg.kind in (wire.Kind.HEARTBEAT, wire.Kind.READY):
            tokens = msg.extras.get("info", {}).get("tokens")
            rates = self._token_rates.get(stage_id)
            if isinstance(tokens, (int, float)) and rates is not None:
                with self._lock:
                    rates.add(time.monotonic(), float(tokens))

    def _chain_steps(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """The recent traces that went through every stage in the topology's order."""
        order = [s.id for s in self.engine.topology.stages]
        with self._lock:
            traces = list(self._traces)
        return [(at, t) for at, t in traces if [hop.get("stage") for hop in t] == order]

    def hops(self) -> list[dict[str, Any]]:
        """driver -> s0 -> ... -> last -> driver, each with its median ms (None: not measured).

        Between stages: the receiver's receive wall clock minus the sender's send wall clock (their
        clocks must agree: exact on one host, NTP's error across hosts). Last stage -> driver: when
        the driver took the reply minus the last stage's send. Driver -> s0: the driver stamps no
        send time, so it is not known."""
        ids = [s.id for s in self.engine.topology.stages]
        steps = self._chain_steps()
        out = [{"from": "driver", "to": ids[0], "ms": None}]
        for i in range(len(ids) - 1):
            gaps = [(t[i + 1]["recv_ns"] - t[i]["send_ns"]) / 1e6 for _, t in steps
                    if "send_ns" in t[i] and "recv_ns" in t[i + 1]]
            out.append({"from": ids[i], "to": ids[i + 1], "ms": _median(gaps)})
        back = [(at - t[-1]["send_ns"]) / 1e6 for at, t in steps if "send_ns" in t[-1]]
        out.append({"from": ids[-1], "to": "driver", "ms": _median(back)})
        return out

    def step_ms(self) -> dict[str, float | None]:
        """Each stage's median compute ms per message over the recent decode steps."""
        with self._lock:
            traces = [t for _, t in self._traces]
        return {s.id: _median([float(hop["compute_ms"]) for t in traces for hop in t
                               if hop.get("stage") == s.id and isinstance(hop.get("compute_ms"), (int, float))])
                for s in self.engine.topology.stages}

    def tokens_per_s(self, stage_id: str) -> float | None:
        with self._lock:
            rate = self._token_rates[stage_id].rate()
        return None if rate is None else round(rate, 1)

    def stages(self) -> list[dict[str, Any]]:
        steps = self.step_ms()
        now = time.monotonic()
        rows = []
        for cfg in self.engine.topology.stages:
            state = self.engine.stages[cfg.id]
            info = dict(state.info)   # replaced whole on each heartbeat: one consistent reading
            row = stage_row(cfg.id, info, host=cfg.host, device=cfg.device, layers=[cfg.start, cfg.end])
            row.update(up=state.ready, step_ms=steps[cfg.id], tokens_per_s=self.tokens_per_s(cfg.id),
                       last_seen_s=round(now - state.last_seen, 2) if state.last_seen else None)
            rows.append(row)
        return rows

    def driver(self) -> dict[str, Any]:
        sched = self.engine.scheduler
        load, spec = dict(sched.load), dict(sched.spec_counts)
        prefix = dict(sched.prefix_counts)
        return {"running": load["running"], "queued": load["queued"],
                "batches_in_flight": load["batches_in_flight"],
                "prefix_cache": {**prefix, "hit_rate": _ratio(prefix["hit"], prefix["hit"] + prefix["miss"])},
                "speculation": {"enabled": bool(self.engine.topology.driver.speculative.enabled),
                                "drafted": spec["drafted"], "accepted": spec["accepted"],
                                "acceptance": _ratio(spec["accepted"], spec["drafted"])}}


def _known(info: dict[str, Any], key: str, zero_unknown: bool = False) -> Any:
    """info[key] when the stage reported it (None when not; 0 too where 0 means "none given")."""
    value = info.get(key)
    return None if value is None or (zero_unknown and value == 0) else value


def stage_row(stage_id: str, info: dict[str, Any], *, host: str | None, device: str | None,
              layers: list[int] | None) -> dict[str, Any]:
    """One stage's row from its heartbeat status (StageWorker.status(); empty before READY)."""
    hits, misses = info.get("cache_hits"), info.get("cache_misses")
    return {"id": stage_id, "host": host, "device": device, "layers": layers,
            "memory": {"weights": _known(info, "weight_bytes"), "kv": _known(info, "kv_bytes"),
                       "cache": _known(info, "cache_bytes"), "rss": _known(info, "rss_bytes"),
                       "plan": _known(info, "predicted_bytes", zero_unknown=True),
                       "budget": _known(info, "memory_budget_bytes", zero_unknown=True)},
            "lanes_in_use": _known(info, "lanes_in_use"), "lanes": _known(info, "lanes"),
            "cache": {"hits": hits, "misses": misses, "entries": _known(info, "cache_entries"),
                      "hit_rate": _ratio(hits, hits + misses) if hits is not None and misses is not None else None},
            "warmups_pending": _known(info, "warmups_pending"), "messages": _known(info, "messages"),
            "errors": _known(info, "errors")}


class ConsoleStatus:
    """What GET /v1/console/status answers for one app; `pipeline` is set when a pipeline is served
    (console.watch_pipeline), else the engine is shown as one local stage."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.pipeline: PipelineTelemetry | None = None
        self._generated = RateWindow()   # the driver's tokens/s, sampled by the status polls
        self._lock = threading.Lock()

    def _metric(self, name: str) -> float | None:
        return self.ctx.metrics.registry.get_sample_value(name)

    def _generated_per_s(self) -> float | None:
        total = self._metric("skippy_generated_tokens_total")
        with self._lock:
            self._generated.add(time.monotonic(), total or 0.0)
            rate = self._generated.rate()
        return None if rate is None else round(rate, 1)

    def build(self) -> dict[str, Any]:
        engine, rate = self.ctx.engine, self._generated_per_s()
        if self.pipeline is not None:
            stages, hops, driver = self.pipeline.stages(), self.pipeline.hops(), self.pipeline.driver()
        else:
            local = stage_row("local", {}, host=None, device=None, layers=None)
            local.update(up=engine.is_ready(), step_ms=None, tokens_per_s=rate, last_seen_s=None)
            stages, hops, driver = [local], [], self._local_driver()
        driver["tokens_per_s"] = rate
        return {"object": "console.status", "model": self.ctx.model_name, "ready": engine.is_ready(),
                "max_context": engine.max_context, "time": time.time(), "driver": driver,
                "stages": stages, "hops": hops}

    def _local_driver(self) -> dict[str, Any]:
        """An engine without stages: what the HTTP layer's own metrics say."""
        running = self._metric("skippy_requests_in_flight")
        windows = self._metric("skippy_spec_acceptance_rate_count") or 0.0
        mean = (self._metric("skippy_spec_acceptance_rate_sum") or 0.0) / windows if windows else None
        return {"running": None if running is None else int(running), "queued": None, "batches_in_flight": None,
                "prefix_cache": None,
                "speculation": {"enabled": None, "drafted": None, "accepted": None,
                                "acceptance": None if mean is None else round(mean, 4)}}
